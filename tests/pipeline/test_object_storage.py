"""`--input` and `--output` on S3, against an S3-compatible server (moto) started by the test on 127.0.0.1: resume,
edited inputs, keys that leave the copy, globs, caches."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pytest

from jobs.generate import main
from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.inputs import load_rows
from tests.pipeline.conftest import NUM_ROWS, job_config, read_output
from tests.tiny_models import WORDS

pytestmark = pytest.mark.slow
BUCKET = "hybridgen-test"
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free local port; AWS_* variables point boto3 and pyarrow at it. Stopped afterwards."""
    import boto3  # test dependencies: moto[server] brings boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    patch = pytest.MonkeyPatch()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }.items():
        patch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield client
    finally:
        patch.undo()
        server.stop()


def _modified(client, prefix: str) -> dict[str, object]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"]: (o["LastModified"], o["ETag"]) for o in listing if o["Key"].endswith(".parquet")}


def test_input_and_output_on_s3_with_resume(s3, checkpoint_dir, dataset, tmp_path, ray_session):
    s3.upload_file(str(dataset), BUCKET, "in/part-a/prompts.jsonl")
    assert load_rows(f"s3://{BUCKET}/in/").to_dict() == load_rows(str(dataset)).to_dict()  # directory
    assert len(load_rows(f"s3://{BUCKET}/in/*/*.jsonl")) == NUM_ROWS  # glob
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(f"s3://{BUCKET}/nothing-here/")
    model = checkpoint_dir("granite_moe")
    run(build_generate_job(job_config(model, dataset, tmp_path / "local")))
    expected = read_output(tmp_path / "local")

    output = f"s3://{BUCKET}/out"
    config = job_config(model, f"s3://{BUCKET}/in/part-a/prompts.jsonl", output)
    run(build_generate_job(config))
    remote_fs, path = pafs.FileSystem.from_uri(output)
    rows = pads.dataset(path, filesystem=remote_fs, format="parquet").to_table().to_pylist()
    assert sorted(rows, key=lambda row: row["id"]) == expected
    assert remote_fs.get_file_info(f"{path}/_SUCCESS").type == pafs.FileType.File

    before = _modified(s3, "out/")
    assert len(before) == NUM_ROWS // 8
    s3.delete_object(Bucket=BUCKET, Key="out/part-00002.parquet")  # as if the driver died before writing it
    run(build_generate_job(config))
    after = _modified(s3, "out/")
    assert {k: v for k, v in after.items() if k != "out/part-00002.parquet"} == {
        k: v for k, v in before.items() if k != "out/part-00002.parquet"
    }  # finished shards untouched
    assert "out/part-00002.parquet" in after
    rows = pads.dataset(path, filesystem=remote_fs, format="parquet").to_table().to_pylist()
    assert sorted(rows, key=lambda row: row["id"]) == expected


def test_an_input_edited_on_s3_is_a_different_job(s3, checkpoint_dir, tmp_path):
    """A remote input is identified by the content of the files copied from it, whatever their names locally:
    unchanged it resumes; one row edited (same size, past the first 1,024) is refused."""
    from pipeline.manifest import prepare_output
    from pipeline.output import OutputDir

    def upload(changed_row: int | None) -> None:
        lines = [f'{{"key": "row-{i:04d}", "text": "{"cat" if i == changed_row else "dog"}"}}' for i in range(2000)]
        s3.put_object(Bucket=BUCKET, Key="animals/prompts.jsonl", Body=("\n".join(lines) + "\n").encode())

    upload(None)
    out = OutputDir(str(tmp_path / "out"))
    config = job_config(checkpoint_dir("granite_moe"), f"s3://{BUCKET}/animals/", tmp_path / "out")
    prepare_output(out, build_generate_job(config), overwrite=False)
    assert prepare_output(out, build_generate_job(config), overwrite=False).done == set()  # a fresh copy: resumes
    upload(1500)
    with pytest.raises(ValueError, match=r"different job \(input_identity\.files\.prompts\.jsonl\.sha256"):
        prepare_output(out, build_generate_job(config), overwrite=False)


def test_object_keys_that_leave_the_copy_directory_are_refused(s3, tmp_path, monkeypatch):
    # S3 keys are plain strings: `a/../b` and `a//abs/path` are valid keys. Joined naively to the temporary directory
    # they point outside it (one level up; the absolute path). The HTTP client also folds `..` out of the URL, so
    # `trap-up/../outside/escaped.jsonl` is read from the key `outside/escaped.jsonl`, which exists here: without
    # the check the copy lands in `copies/outside/`. Every such key must be refused, named, before anything is read.
    copies = tmp_path / "copies"
    copies.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(copies))  # the copy goes to copies/hybridgen-input-…
    line = b'{"text": "hello"}\n'
    absolute = tmp_path / "escaped.jsonl"
    keys = {"trap-up": "trap-up/../outside/escaped.jsonl", "trap-abs": f"trap-abs/{absolute}"}  # trap-abs//tmp/…
    for key in ("trap-up/ok.jsonl", "trap-abs/ok.jsonl", "outside/escaped.jsonl", *keys.values()):
        s3.put_object(Bucket=BUCKET, Key=key, Body=line)
    for prefix, key in keys.items():
        for uri in (f"s3://{BUCKET}/{prefix}/", f"s3://{BUCKET}/{prefix}/*.jsonl"):
            with pytest.raises(ValueError, match=re.escape(f"input object 's3://{BUCKET}/{key}' leads outside")):
                load_rows(uri)
    assert not absolute.exists() and not (copies / "outside").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copies"]
    assert all(p.name.startswith("hybridgen-input-") for p in copies.iterdir())


def _write_jsonl(path: Path, keys: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"key": key, "text": f"the {WORDS[i % len(WORDS)]}"}) + "\n" for i, key in enumerate(keys))
    )


def test_a_remote_glob_matches_what_a_local_glob_matches(s3, checkpoint_dir, tmp_path, ray_session):
    """`prompts/*.jsonl` reads the folder's files, not its `backup/` sub-folder (fnmatch's `*` crossed `/`: the
    backed-up rows came twice); `**` and `*/` read deeper levels, as a local glob does."""
    local = tmp_path / "prompts"
    _write_jsonl(local / "a.jsonl", ["a-0", "a-1"])
    _write_jsonl(local / "b.jsonl", ["b-0"])
    _write_jsonl(local / "backup" / "a.jsonl", ["a-0", "a-1"])  # yesterday's copy of a.jsonl
    _write_jsonl(local / "backup" / "old" / "c.jsonl", ["c-0"])
    _write_jsonl(local / ".hidden.jsonl", ["h-0"])
    for path in local.rglob("*.jsonl"):
        s3.upload_file(str(path), BUCKET, f"globbed/{path.relative_to(local)}")
    for pattern in ("*.jsonl", "*/*.jsonl", "**/*.jsonl", "backup/**", "b*.jsonl", "?.jsonl"):
        remote = sorted(load_rows(f"s3://{BUCKET}/globbed/{pattern}")["key"])
        assert remote == sorted(load_rows(str(local / pattern))["key"]), pattern
    paths = ["--model", str(checkpoint_dir("granite_moe")), "--input", f"s3://{BUCKET}/globbed/*.jsonl"]
    flags = ["--prompt-column", "text", "--id-column", "key", "--max-tokens", "2", "--num-workers", "1"]
    argv = [*paths, *flags, "--ray-address", "local", "--output", str(tmp_path / "out")]
    assert main(argv) == 0
    assert [row["id"] for row in read_output(tmp_path / "out")] == ["a-0", "a-1", "b-0"]


def test_runs_on_an_object_storage_input_leave_nothing_in_caches(s3, checkpoint_dir, tmp_path):
    """Each run copies the remote input to a new temporary directory; `datasets` keyed its cache by that path, so
    every run added a full copy of the input to ~/.cache/huggingface/datasets, never removed. Two CLI runs (the
    second resumes): the datasets cache stays empty and no temporary directory outlives its run."""
    _write_jsonl(tmp_path / "prompts.jsonl", [f"row-{i:04d}" for i in range(500)])
    s3.upload_file(str(tmp_path / "prompts.jsonl"), BUCKET, "cached/prompts.jsonl")
    scratch = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))  # short: Ray's socket paths live under TMPDIR too
    hf_cache = tmp_path / "hf-datasets"
    env = {**os.environ, "TMPDIR": str(scratch), "HF_DATASETS_CACHE": str(hf_cache)}
    paths = ["--model", str(checkpoint_dir("granite_moe")), "--input", f"s3://{BUCKET}/cached/prompts.jsonl"]
    flags = ["--prompt-column", "text", "--id-column", "key", "--max-tokens", "1", "--rows-per-shard", "250"]
    scaling = ["--num-workers", "1", "--ray-address", "local", "--output", str(tmp_path / "out")]
    command = [sys.executable, "jobs/generate.py", *paths, *flags, *scaling]
    try:
        for _ in range(2):
            result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-3000:]
            assert not any(p.is_file() for p in hf_cache.rglob("*")), sorted(hf_cache.rglob("*"))[:5]
            assert not [p.name for p in scratch.iterdir() if p.name.startswith("hybridgen-")]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
