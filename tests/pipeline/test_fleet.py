"""A job never hangs on a local Ray: workers that cannot start or cannot be placed are named, bounded, reported.

Each test runs `jobs/generate.py` in a subprocess with its own local Ray (2 CPUs here) and a hard timeout, so a
regression shows up as a failed test, not a hung suite.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.pipeline.conftest import NUM_ROWS, read_output, write_dataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def _generate(model: Path, data: Path, output: Path, *flags: str, env: dict | None = None, timeout: float = 240):
    command = [sys.executable, "jobs/generate.py", "--model", str(model), "--input", str(data), "--prompt-column",
               "text", "--id-column", "key", "--max-model-len", "40", "--max-tokens", "4", "--temperature", "0",
               "--ignore-eos", "--rows-per-shard", "8", "--output", str(output), *flags]  # fmt: skip
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("fleet") / "prompts.jsonl")


def test_worker_start_failures_are_printed_and_bounded(checkpoint_dir, data, tmp_path):
    model = Path(shutil.copytree(checkpoint_dir("bamba"), tmp_path / "model"))
    (model / "tokenizer.json").write_text("{ not a tokenizer")  # passes the driver's checks, fails on the worker
    start = time.monotonic()
    result = _generate(
        model,
        data,
        tmp_path / "out",
        "--ray-address",
        "local",
        "--num-workers",
        "2",
        "--max-worker-start-failures",
        "3",
    )
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "failed to start" in line]
    assert len(lines) == 3, result.stderr[-3000:]  # two printed as they happen, the third ends the job
    assert all("a worker failed to start on node " in line for line in lines)
    assert "(1 of at most 3; starting another)" in lines[0]
    assert lines[-1].startswith("error: 3 workers failed to start (--max-worker-start-failures 3); the last: ")
    assert "Exception" in lines[-1] or "Error" in lines[-1]  # the worker's exception type and message
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 180
    assert not list((tmp_path / "out").glob("part-*"))


def test_pending_workers_are_named_and_the_startup_timeout_says_why(checkpoint_dir, data, tmp_path):
    result = _generate(
        checkpoint_dir("bamba"),
        data,
        tmp_path / "out",
        "--ray-address",
        "local",
        "--device",
        "cuda",
        "--num-workers",
        "2",
        "--worker-startup-timeout-s",
        "6",
    )
    assert result.returncode == 1, result.stderr[-3000:]
    why = "2 workers need {CPU: 1, GPU: 1}: no node has GPU ≥ 1 (cluster total 0), and no autoscaler is running"
    assert f"waiting for workers (0 ready): {why}" in result.stderr  # said while waiting, at intervals
    assert f"error: no worker started within 6 s: {why}" in result.stderr
    assert "Traceback" not in result.stderr


def test_work_starts_with_fewer_workers_than_requested(checkpoint_dir, data, tmp_path):
    # 3 workers of 1 CPU on a 2-CPU local Ray: two are placed, the third waits; the job must not wait for it.
    result = _generate(
        checkpoint_dir("bamba"),
        data,
        tmp_path / "out",
        "--ray-address",
        "local",
        "--num-workers",
        "3",
        "--cpus-per-worker",
        "1",
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["id"] for row in read_output(tmp_path / "out")] == [f"row-{i:03d}" for i in range(NUM_ROWS)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stale_recorded_cluster_is_skipped_and_a_dead_address_fails_fast(checkpoint_dir, data, tmp_path):
    # A head that died uncleanly leaves its address in Ray's temp dir; here a private temp dir (RAY_TMPDIR).
    ray_tmp = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        dead = f"127.0.0.1:{_free_port()}"
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
        env = {"RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""}
        result = _generate(checkpoint_dir("bamba"), data, tmp_path / "out", "--num-workers", "1", env=env, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"no Ray cluster answers at {dead} (recorded in {ray_tmp}/ray/ray_current_cluster" in result.stderr
        assert len(read_output(tmp_path / "out")) == NUM_ROWS
        start = time.monotonic()
        result = _generate(checkpoint_dir("bamba"), data, tmp_path / "out2", "--ray-address", dead, env=env, timeout=60)
        assert result.returncode == 1 and time.monotonic() - start < 45, result.stderr[-3000:]
        assert f"error: no Ray cluster answers at {dead} (--ray-address) within 10 s" in result.stderr
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
