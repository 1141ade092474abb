"""Hub models are pinned: the driver resolves the commit once, checks and fingerprints that commit, and every worker
loads it; a push that changes no file deciding the output (a README) does not block resume. The hub is faked with
local checkpoints (no network)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest

from pipeline.generate import build_generate_job
from pipeline.manifest import prepare_output
from pipeline.output import OutputDir
from pipeline.preflight import read_safetensors_header
from tests.pipeline.conftest import job_config, write_dataset
from workers.actor import ShardWorker


class FakeHub:
    """Repo id → a local directory as its files and a branch/tag → commit table; records each call's revision."""

    def __init__(self) -> None:
        self.repos: dict[str, Path] = {}
        self.refs: dict[str, dict[str, str]] = {}
        self.calls: list[tuple[str, str, str | None]] = []  # (function, repo, revision asked for)

    def push(self, repo: str, commit: str, directory: Path | None = None) -> None:
        """A new commit on main (the files are whatever the directory holds now)."""
        self.repos[repo] = directory or self.repos[repo]
        self.refs.setdefault(repo, {})["main"] = commit

    def commit(self, repo: str, revision: str | None) -> str:
        refs = self.refs[repo]
        return refs.get(revision or "main", revision)

    def model_info(self, api, repo_id, revision=None, files_metadata=False, **kwargs):
        self.calls.append(("model_info", repo_id, revision))
        siblings = []
        for path in sorted(p for p in self.repos[repo_id].rglob("*") if p.is_file()):
            data = path.read_bytes()
            lfs = SimpleNamespace(sha256=hashlib.sha256(data).hexdigest()) if path.suffix == ".safetensors" else None
            siblings.append(
                SimpleNamespace(
                    rfilename=str(path.relative_to(self.repos[repo_id])),
                    size=len(data),
                    lfs=lfs,
                    blob_id=hashlib.sha1(data).hexdigest(),
                )
            )
        return SimpleNamespace(sha=self.commit(repo_id, revision), siblings=siblings, config={})

    def hf_hub_download(self, repo_id, filename, revision=None, **kwargs):
        self.calls.append(("hf_hub_download", repo_id, revision))
        return str(self.repos[repo_id] / filename)

    def get_safetensors_metadata(self, repo_id, revision=None, **kwargs):
        self.calls.append(("get_safetensors_metadata", repo_id, revision))
        shapes = read_safetensors_header(self.repos[repo_id] / "model.safetensors")
        tensors = {key: SimpleNamespace(shape=list(shape)) for key, shape in shapes.items()}
        return SimpleNamespace(files_metadata={"model.safetensors": SimpleNamespace(tensors=tensors)})

    def snapshot_download(self, repo_id, revision=None, **kwargs):
        self.calls.append(("snapshot_download", repo_id, revision))
        return str(self.repos[repo_id])


@pytest.fixture
def hub(checkpoint_dir, tmp_path, monkeypatch) -> FakeHub:
    """org/target (a tiny hybrid, also tagged v1.0 at an older commit) and org/draft, served from local copies."""
    fake = FakeHub()
    for repo, family in (("org/target", "granite_moe"), ("org/draft", "draft_attention")):
        fake.push(repo, hashlib.sha1(repo.encode()).hexdigest(), tmp_path / repo)
        shutil.copytree(checkpoint_dir(family), tmp_path / repo)
    fake.refs["org/target"]["v1.0"] = "1" * 40
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda api, *a, **k: fake.model_info(api, *a, **k))
    for name in ("hf_hub_download", "get_safetensors_metadata", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, getattr(fake, name))
    return fake


def test_every_worker_loads_the_commit_the_driver_resolved(hub, tmp_path):
    target, draft = hub.commit("org/target", None), hub.commit("org/draft", None)
    data = write_dataset(tmp_path / "prompts.jsonl")
    config = job_config("org/target", data, tmp_path / "out", speculative="draft", draft_model="org/draft")
    job = build_generate_job(config)
    asked = {(repo, revision) for function, repo, revision in hub.calls if function != "model_info"}
    assert asked == {("org/target", target), ("org/draft", draft)}  # preflight read the resolved commits
    hub.push("org/target", "2" * 40)  # a push while the job runs
    hub.calls.clear()
    worker = ShardWorker(job.worker)
    assert worker.start_error is None
    assert hub.calls == [("snapshot_download", "org/target", target), ("snapshot_download", "org/draft", draft)]
    tagged = build_generate_job(job_config("org/target", data, tmp_path / "out", revision="v1.0"))
    assert tagged.worker.revision == "1" * 40


def test_a_push_that_changes_no_file_deciding_the_output_keeps_resume(hub, tmp_path):
    data, out = write_dataset(tmp_path / "prompts.jsonl"), tmp_path / "out"

    def prepare():
        return prepare_output(OutputDir(str(out)), build_generate_job(job_config("org/target", data, out)), False)

    prepare()
    (hub.repos["org/target"] / "README.md").write_text("# a model card\n")
    hub.push("org/target", "3" * 40)
    assert prepare().done == set()  # resumes, and records the new commit
    config_file = hub.repos["org/target"] / "config.json"
    config_file.write_text(config_file.read_text().replace("1e-06", "1e-05"))
    hub.push("org/target", "4" * 40)
    with pytest.raises(ValueError, match=r"different job \(model_identity\.files\.config\.json\.blob_id"):
        prepare()


def test_a_readme_or_license_in_a_local_model_directory_keeps_resume(checkpoint_dir, tmp_path):
    model, data, out = tmp_path / "model", write_dataset(tmp_path / "prompts.jsonl"), tmp_path / "out"
    shutil.copytree(checkpoint_dir("granite_moe"), model)

    def prepare():
        return prepare_output(OutputDir(str(out)), build_generate_job(job_config(model, data, out)), False)

    prepare()
    (model / "README.md").write_text("# a model card\n")
    (model / "LICENSE").write_text("Apache-2.0\n")
    assert prepare().done == set()


def test_a_revision_for_a_local_model_directory_is_refused(checkpoint_dir, tmp_path):
    data = write_dataset(tmp_path / "prompts.jsonl")
    config = job_config(checkpoint_dir("granite_moe"), data, tmp_path / "out", revision="v1.0")
    with pytest.raises(ValueError, match=r"--revision 'v1.0' is for hub repo ids, not a local model directory"):
        build_generate_job(config)
