"""A real local cluster: `ray start --head`, `ray job submit -- python jobs/generate.py …`, SUCCEEDED, output checked."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.pipeline.conftest import NUM_ROWS, read_output, write_dataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
RAY = str(Path(sys.executable).parent / "ray")
# Ray 2.5x+ clusters use token authentication: the cluster and the CLI share a token, here a fresh one per run
# (a fresh machine has no ~/.ray/auth_token). `python` in the job's entrypoint must be this environment's interpreter.
ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
       "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster():
    """A one-node Ray cluster started with the CLI, dashboard on localhost; stopped afterwards."""
    import ray

    ray.shutdown()  # no in-process session may linger from other tests
    port, dashboard = _free_port(), _free_port()
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard}", "--disable-usage-stats"],
                   check=True, capture_output=True, timeout=120, env=ENV)  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_agent(address)
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=ENV)


def _wait_for_job_agent(address: str, timeout_s: float = 90.0) -> None:
    """`ray start` returns before the job agent accepts submissions; wait until `ray job list` answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = subprocess.run([RAY, "job", "list", "--address", address], capture_output=True, env=ENV, timeout=60)
        if listing.returncode == 0:
            return
        time.sleep(1.0)
    raise TimeoutError(f"the Ray job server at {address} did not come up within {timeout_s:.0f} s")


def test_ray_job_submit_runs_the_generate_job(cluster, checkpoint_dir, tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl")
    job_id = f"hybridgen-test-{uuid.uuid4().hex[:8]}"
    output = tmp_path / "out"
    submit = [RAY, "job", "submit", "--address", cluster, "--submission-id", job_id, "--working-dir", str(ROOT), "--",
              "python", "jobs/generate.py", "--model", str(checkpoint_dir("bamba")), "--input", str(dataset),
              "--prompt-column", "text", "--id-column", "key", "--max-tokens", "4", "--temperature", "0",
              "--max-model-len", "40", "--num-workers", "2", "--rows-per-shard", "16", "--output", str(output)]  # fmt: skip
    for _ in range(10):  # the job agent may still be starting: Ray answers "No available agent", try again
        result = subprocess.run(submit, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
        if "No available agent" not in result.stderr + result.stdout:
            break
        time.sleep(3.0)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = subprocess.run(
        [RAY, "job", "status", "--address", cluster, job_id], capture_output=True, text=True, env=ENV
    )
    assert "succeeded" in (status.stdout + status.stderr).lower()  # "Job ... succeeded" (status SUCCEEDED)
    rows = read_output(output)
    assert [row["id"] for row in rows] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    assert (output / "_SUCCESS").exists()
