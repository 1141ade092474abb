"""What a user meets when an input, an id column, a config file or an output directory cannot be used: one line,
exit status 2, before any worker starts, and the output directory exactly as it was (no Ray here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.driver
from jobs.generate import main
from pipeline.generate import build_generate_job
from pipeline.lock import LOCK, OutputLock
from pipeline.manifest import prepare_output
from pipeline.output import OutputDir
from tests.pipeline.conftest import job_config

ROOT = Path(__file__).parents[2]


@pytest.fixture
def no_ray(monkeypatch):
    """Reaching Ray would mean the refusal came too late: fail instead."""

    def refuse(address):
        raise AssertionError("the job reached Ray")

    monkeypatch.setattr(pipeline.driver, "connect", refuse)


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("bamba")


def _argv(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--input", str(data), "--prompt-column", "text", "--output", str(output), *extra]


def _refused(argv: list[str], capsys) -> str:
    """Run the CLI; it must exit 2 with its last stderr line `error: …` and no traceback. That line."""
    capsys.readouterr()  # what fixtures printed (building checkpoints)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), err
    assert sum(line.startswith("error: ") for line in lines) == 1 and "Traceback" not in err, err
    return lines[-1]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.is_dir() else {}


def _zero_row_parquet(path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)


@pytest.mark.parametrize(
    "name,write,message",
    [
        ("empty.jsonl", lambda p: p.write_bytes(b""), "input file '{path}' is empty (0 bytes)"),
        ("blank.jsonl", lambda p: p.write_text("\n\n"), "cannot be read as JSON: it holds no rows"),
        ("cut.jsonl", lambda p: p.write_text('{"text": "a"}\n{"text": "b'), "cannot be read as JSON: ArrowInvalid: "),
        ("latin1.csv", lambda p: p.write_bytes("text\ncafé crème\n".encode("latin-1")), "re-encode it as UTF-8"),
        ("empty.parquet", lambda p: p.write_bytes(b""), "input file '{path}' is empty (0 bytes)"),
        ("no_rows.parquet", _zero_row_parquet, "input file '{path}' holds no rows"),
    ],
)
def test_an_empty_or_malformed_input_is_refused_in_one_line(name, write, message, model, tmp_path, capsys, no_ray):
    data = tmp_path / name
    write(data)
    line = _refused(_argv(model, data, tmp_path / "out"), capsys)
    assert message.format(path=data) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "lines,flag,named",
    [
        # A CSV id column read as written: "007" and "7" are two ids; "007" twice and an empty id are refused.
        (
            ["key,text", "007,a", "7,b", "007,c", ",d"],
            ["--id-column", "key"],
            "--id-column 'key': 1 rows have no id (null or empty: rows 3); 1 ids occur more than once: '007' (rows 0, 2)",
        ),
        # JSONL ids of mixed types keep their text: 1 and "1" are the same id, written twice.
        (
            ['{"key": 1, "text": "a"}', '{"key": "1", "text": "b"}', '{"key": "x", "text": "c"}'],
            ["--id-column", "key"],
            "1 ids occur more than once: '1' (rows 0, 1)",
        ),
        # The input's own `id` column is the output id: null ids are refused too.
        (
            ['{"id": "a", "text": "x"}', '{"id": null, "text": "y"}'],
            [],
            "the input's `id` column (the output `id`): 1 rows have no id (null or empty: rows 1)",
        ),
    ],
)
def test_duplicate_or_missing_ids_are_refused_naming_them(lines, flag, named, model, tmp_path, capsys, no_ray):
    data = tmp_path / ("ids.csv" if "," in lines[0] and "{" not in lines[0] else "ids.jsonl")
    data.write_text("\n".join(lines) + "\n")
    line = _refused(_argv(model, data, tmp_path / "out", *flag), capsys)
    assert named in line and "each row needs an id of its own" in line
    assert not (tmp_path / "out").exists()


def _stray_part(out: Path) -> None:
    (out / "part-00000.parquet").write_bytes(b"someone else's file")


def _corrupt_manifest(out: Path) -> None:
    (out / "_manifest.json").write_text('{"job": "generate", "fingerpr')  # cut short


@pytest.mark.parametrize(
    "setup,message",
    [
        (_stray_part, "holds a different job (1 part files without a _manifest.json); use --overwrite"),
        (_corrupt_manifest, "/_manifest.json is not valid JSON (Unterminated string"),
    ],
)
def test_an_output_holding_something_else_is_refused_untouched(setup, message, model, tmp_path, capsys, no_ray):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat"}\n')
    out = tmp_path / "out"
    out.mkdir()
    setup(out)
    (out / ".notes.txt.tmp").write_text("a user's file")  # not this code's temporary: never removed
    (out / f"._manifest.json.{'ab' * 16}.tmp").write_text("{")  # this code's, left by a crash
    before = _snapshot(out)
    assert message in _refused(_argv(model, data, out), capsys)
    assert _snapshot(out) == before  # checked before anything in it was touched


def test_an_output_that_is_a_file_is_refused(model, tmp_path, capsys, no_ray):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat"}\n')
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert f"--output {target} is a file, not a directory" in _refused(_argv(model, data, target), capsys)
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_tokens: 8\nsampling:\n  top_p: [0.5\n", "not valid YAML ("),
        ("1: 2\n", "key 1 is not a flag name"),
        ("sampling:\n  null: 3\n", "key None is not a flag name"),
        ("- max_tokens\n", "expected a mapping of flag names to values"),
    ],
)
def test_a_bad_config_file_is_refused_in_one_line(text, message, model, tmp_path, capsys, no_ray):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat"}\n')
    config = tmp_path / "job.yaml"
    config.write_text(text)
    line = _refused(_argv(model, data, tmp_path / "out", "--config", str(config)), capsys)
    assert f"--config {config}: " in line and message in line
    assert not (tmp_path / "out").exists()


def test_a_config_path_that_is_a_directory_is_refused(model, tmp_path, capsys, no_ray):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat"}\n')
    line = _refused(_argv(model, data, tmp_path / "out", "--config", str(tmp_path)), capsys)
    assert f"--config {tmp_path}: cannot be read (Is a directory)" in line


def _hold_lock(out: Path) -> subprocess.Popen:
    """Another process that takes the output's lock and keeps it (until killed)."""
    code = (
        "import sys, time\nfrom pipeline.lock import OutputLock\nfrom pipeline.output import OutputDir\n"
        "OutputLock(OutputDir(sys.argv[1])).acquire()\nprint('held', flush=True)\ntime.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_on_a_locked_output_is_refused_and_a_dead_holder_is_stale(
    model, dataset, tmp_path, capsys, no_ray
):
    out = tmp_path / "out"
    out.mkdir()
    holder = _hold_lock(out)
    try:
        before = _snapshot(out)
        line = _refused(_argv(model, dataset, out, "--id-column", "key"), capsys)
        assert f"output {out} is in use by another run (pid {holder.pid} on " in line
        assert _snapshot(out) == before
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # as a driver killed mid-run: its marker stays
        holder.wait()
    assert json.loads((out / LOCK).read_text())["pid"] == holder.pid
    with OutputLock(OutputDir(str(out))) as lock:  # the holder is gone: its marker is stale and taken over
        assert json.loads((out / LOCK).read_text())["token"] == lock.owner["token"]
    assert not (out / LOCK).exists()  # released


def test_only_this_codes_temporaries_are_removed(model, dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ours = out / f".part-00001.parquet.{'0f' * 16}.tmp"
    ours.write_bytes(b"half a shard")
    theirs = [out / ".draft.tmp", out / ".part-00001.parquet.tmp", out / "notes.txt"]
    for path in theirs:
        path.write_text("a user's file")
    prepare_output(OutputDir(str(out)), build_generate_job(job_config(model, dataset, out)), overwrite=False)
    assert not ours.exists() and all(path.read_text() == "a user's file" for path in theirs)
