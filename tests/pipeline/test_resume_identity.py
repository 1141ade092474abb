"""Resume trusts nothing that changed: model weights, config, tokenizer, draft model, input rows (no Ray needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.generate import build_generate_job
from pipeline.manifest import prepare_output
from pipeline.output import MANIFEST, OutputDir
from tests.pipeline.conftest import job_config, write_dataset


@pytest.fixture
def setup(checkpoint_dir, tmp_path):
    """Own copies of a model, a draft and a dataset, and a prepared output directory for them."""
    model, draft = tmp_path / "model", tmp_path / "draft"
    shutil.copytree(checkpoint_dir("granite_moe"), model)
    shutil.copytree(checkpoint_dir("draft_attention"), draft)
    data = write_dataset(tmp_path / "prompts.jsonl")
    out = tmp_path / "out"

    def prepare(overwrite: bool = False, **overrides):
        config = job_config(model, data, out, speculative="draft", draft_model=str(draft), **overrides)
        return prepare_output(OutputDir(str(out)), build_generate_job(config), overwrite)

    first = prepare()
    assert prepare().done == first.done == set()  # unchanged: resumes
    return model, draft, data, out, prepare


def _flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "change,named",
    [
        (lambda m, d, data: _flip_byte(m / "model.safetensors", 1000), "model_identity.files.model.safetensors"),
        (
            lambda m, d, data: (m / "config.json").write_text(
                json.dumps({**json.loads((m / "config.json").read_text()), "rms_norm_eps": 1e-3})
            ),
            "model_identity.files.config.json",
        ),
        (
            lambda m, d, data: (m / "tokenizer.json").write_text(
                (m / "tokenizer.json").read_text().replace('"cat"', '"cow"')
            ),
            "model_identity.files.tokenizer.json",
        ),
        (lambda m, d, data: _flip_byte(d / "model.safetensors", 5000), "draft_model_identity.files.model.safetensors"),
        (
            lambda m, d, data: data.write_text(data.read_text().replace("row-003", "row-993")),
            "input_identity.files.prompts.jsonl.sha256",
        ),
        (lambda m, d, data: write_dataset(data, num_rows=49), "input_identity.num_rows"),
    ],
    ids=["weights", "config", "tokenizer", "draft", "input-contents", "input-rows"],
)
def test_a_changed_model_draft_or_input_is_refused_naming_what_changed(setup, change, named):
    model, draft, data, out, prepare = setup
    change(model, draft, data)
    with pytest.raises(ValueError, match=rf"different job \(.*{named}.*use --overwrite"):
        prepare()
    assert prepare(overwrite=True).done == set()
    prepare()  # and the replaced job now resumes


def test_unseeded_job_draws_its_seed_once_records_it_and_keeps_it_on_resume(setup):
    model, draft, data, out, prepare = setup
    manifest = json.loads((out / MANIFEST).read_text())
    seed = manifest["sampling_seed"]
    assert isinstance(seed, int) and prepare().seed == seed
    assert json.loads((out / MANIFEST).read_text())["sampling_seed"] == seed
    assert len(json.loads((out / MANIFEST).read_text())["runs"]) == 3  # setup prepared twice, then once more
    assert prepare(overwrite=True, max_tokens=5).seed != seed  # a new job draws afresh
    assert prepare(overwrite=True, seed=7).seed == 7


def test_enforce_eager_reaches_the_workers_and_a_job_resumes_across_it(setup, monkeypatch):
    """--enforce-eager is a performance-only flag: the CLI builds it, the worker spec and the runner get it (both
    jobs share `worker_spec`), the fingerprint leaves it out."""
    from pipeline.cli import parse_sections
    from pipeline.config import ModelConfig
    from pipeline.job import worker_spec
    from workers.actor import ShardWorker

    model, _, data, out, prepare = setup
    assert prepare(enforce_eager=True).done == set()  # resumes: the same job
    parsed = parse_sections("job", {"model": ModelConfig}, ["--model", str(model), "--enforce-eager"])["model"]
    assert parsed.enforce_eager and not ModelConfig(model=str(model)).enforce_eager
    assert worker_spec("score", parsed).enforce_eager
    arguments = {}
    monkeypatch.setattr(
        "workers.actor.ModelRunner.from_pretrained",
        lambda path, config: arguments.update(cuda_graphs=config.execution.cuda_graphs),
    )
    ShardWorker(worker_spec("generate", parsed))
    assert arguments["cuda_graphs"] is False
    ShardWorker(worker_spec("generate", ModelConfig(model=str(model))))
    assert arguments["cuda_graphs"] is None  # the runner's default: graphs on CUDA only


def _write_animals(path: Path, changed_row: int | None = None) -> Path:
    """2,000 JSONL rows of "dog"; `changed_row` says "cat" instead (the file keeps its byte size)."""
    lines = [json.dumps({"key": f"row-{i:04d}", "text": "cat" if i == changed_row else "dog"}) for i in range(2000)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_row_edited_anywhere_in_the_input_is_refused(checkpoint_dir, tmp_path):
    """Every row counts, not a sample: row 1,500 of 2,000 edited, same byte size, is a different job."""
    data, out = _write_animals(tmp_path / "prompts.jsonl"), tmp_path / "out"
    config = job_config(checkpoint_dir("granite_moe"), data, out)
    prepare_output(OutputDir(str(out)), build_generate_job(config), overwrite=False)
    size = data.stat().st_size
    _write_animals(data, changed_row=1500)
    assert data.stat().st_size == size
    with pytest.raises(ValueError, match=r"different job \(input_identity\.files\.prompts\.jsonl\.sha256"):
        prepare_output(OutputDir(str(out)), build_generate_job(config), overwrite=False)


def test_a_hub_dataset_is_read_at_the_commit_its_identity_records(checkpoint_dir, tmp_path, monkeypatch):
    """The driver resolves a hub dataset's commit once, reads the rows at that commit and records it: a push to
    the dataset between two runs is a different job."""
    from types import SimpleNamespace

    import datasets
    import huggingface_hub

    commits, loaded = ["a" * 40], []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, name, **k: SimpleNamespace(sha=commits[-1]))

    def load_dataset(name, split, revision=None, **kwargs):
        loaded.append((name, split, revision))
        return datasets.Dataset.from_dict({"key": ["a", "b"], "text": ["the cat", "a dog"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    out = tmp_path / "out"
    config = job_config(checkpoint_dir("granite_moe"), "org/prompts", out)
    job = build_generate_job(config)
    assert loaded == [("org/prompts", "train", "a" * 40)]
    assert job.fingerprint["input_identity"]["revision"] == "a" * 40
    prepare_output(OutputDir(str(out)), job, overwrite=False)
    commits.append("b" * 40)
    with pytest.raises(ValueError, match=r"different job \(input_identity\.revision: 'aaa"):
        prepare_output(OutputDir(str(out)), build_generate_job(config), overwrite=False)
