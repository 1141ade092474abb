"""A real local cluster: `ray start --head`, `ray job submit -- python jobs/generate.py …`, SUCCEEDED, output checked.

The machine has run a local job before (so `~/.ray/auth_token` exists and the new head enables Ray's token
authentication): `ray job submit` must then be given the token as the README says, `RAY_AUTH_MODE=token`. The
cluster gets a private HOME and Ray temp dir, and is stopped by SIGTERM to the `ray start --block` process this test
started (never `ray stop`, which stops every Ray on the machine).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.pipeline.conftest import NUM_ROWS, read_output, write_dataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def machine(tmp_path) -> dict[str, str]:
    """Environment of a user whose earlier local job left a Ray token in ~/.ray (here a private HOME)."""
    home, ray_tmp = tmp_path / "home", tempfile.mkdtemp(prefix="hg-", dir="/tmp")  # short: Ray's socket paths
    kernels = os.environ.get("HYBRIDGEN_KERNEL_CACHE", str(Path.home() / ".cache" / "hybridgen" / "kernels"))
    env = {**os.environ, "HOME": str(home), "RAY_TMPDIR": ray_tmp, "HYBRIDGEN_KERNEL_CACHE": kernels,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS"):
        env.pop(name, None)
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, env=env, timeout=60)
    assert (home / ".ray" / "auth_token").exists()
    yield env
    subprocess.run(["rm", "-rf", ray_tmp], check=False)


@pytest.fixture
def cluster(machine):
    """A one-node cluster started as a user would (`ray start --head`, dashboard on localhost); stopped by pid."""
    import ray

    ray.shutdown()  # no in-process session may linger from other tests
    dashboard = _free_port()
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={_free_port()}",
            "--num-cpus=2",
            "--block",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            "--disable-usage-stats",
        ],
        env=machine,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_agent(address, {**machine, "RAY_AUTH_MODE": "token"}, head)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # its children (GCS, raylet, dashboard, workers) follow
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the session this test started, nothing else
            head.wait(timeout=30)


def _wait_for_job_agent(address: str, env: dict[str, str], head: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """`ray start` returns before the job agent accepts submissions; wait until `ray job list` answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        listing = subprocess.run([RAY, "job", "list", "--address", address], capture_output=True, env=env, timeout=60)
        if listing.returncode == 0:
            return
        time.sleep(1.0)
    raise TimeoutError(f"the Ray job server at {address} did not come up within {timeout_s:.0f} s")


def _submit(address: str, env: dict[str, str], job_id: str, *job_args: str) -> subprocess.CompletedProcess:
    submit = [RAY, "job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", str(ROOT),
              "--", "python", "jobs/generate.py", *job_args]  # fmt: skip
    deadline = time.monotonic() + 120.0  # the job agent may still be starting (slower on a loaded machine)
    while True:  # Ray answers "No available agent" until it is up: try again
        result = subprocess.run(submit, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        if "No available agent" not in result.stderr + result.stdout or time.monotonic() > deadline:
            return result
        time.sleep(3.0)


def test_ray_job_submit_runs_the_generate_job(cluster, machine, checkpoint_dir, tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl")
    output = tmp_path / "out"
    job_args = ["--model", str(checkpoint_dir("bamba")), "--input", str(dataset), "--prompt-column", "text",
                "--id-column", "key", "--max-tokens", "4", "--temperature", "0", "--max-model-len", "40",
                "--num-workers", "2", "--rows-per-shard", "16", "--output", str(output)]  # fmt: skip
    refused = _submit(cluster, machine, f"hybridgen-test-{uuid.uuid4().hex[:8]}", *job_args)
    assert refused.returncode != 0 and "AuthenticationError" in refused.stdout + refused.stderr  # the trap
    readme = (ROOT / "README.md").read_text()
    assert "RAY_AUTH_MODE=token ray job submit" in readme  # the README's way out, used below
    job_id = f"hybridgen-test-{uuid.uuid4().hex[:8]}"
    token_env = {**machine, "RAY_AUTH_MODE": "token"}
    result = _submit(cluster, token_env, job_id, *job_args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = subprocess.run(
        [RAY, "job", "status", "--address", cluster, job_id], capture_output=True, text=True, env=token_env
    )
    assert "succeeded" in (status.stdout + status.stderr).lower()  # "Job ... succeeded" (status SUCCEEDED)
    rows = read_output(output)
    assert [row["id"] for row in rows] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    assert (output / "_SUCCESS").exists()
