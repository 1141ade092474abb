"""Autoscaling for real on one machine: Ray's fake multi-node provider launches worker nodes for pending workers.

The head has no CPUs and the only worker node type mirrors `cluster.yaml`'s `gpu_worker` (1 GPU, an L40S, scaled
down to 1 CPU, 0…2 nodes) plus a custom resource. Workers compute on CPU but ask for that node type through
`--accelerator-type` and `--worker-resources`. The job starts with no worker node, nodes are launched for its
pending workers, every row is written once, and the nodes go once the queue drains. The head is started by this
test (`ray start --head --block`, private Ray temp dir, a free GCS port the fake nodes are told about) and stopped
by SIGTERM to its process id.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from pipeline.driver import run
from pipeline.generate import build_generate_job
from tests.pipeline.conftest import NUM_ROWS, job_config, read_output

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
RAY = str(Path(sys.executable).parent / "ray")
EMPTY_KEYS = ["file_mounts", "auth", "docker"]
EMPTY_LISTS = ["cluster_synced_files", "rsync_exclude", "rsync_filter", "initialization_commands", "setup_commands",
               "head_setup_commands", "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaling_config(gcs_address: str) -> dict:
    """A fake-provider cluster config whose worker node type mirrors cluster.yaml's (scaled to this machine)."""
    shipped = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    gpu_worker = shipped["available_node_types"]["gpu_worker"]
    resources = {**gpu_worker["resources"], "CPU": 1, "accelerator_type:L40S": 1, "gpu_worker_node": 1}
    return {
        "cluster_name": "hybridgen-fake",
        "max_workers": 2,
        "upscaling_speed": shipped["upscaling_speed"],
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": shipped["available_node_types"]["head"]["resources"],
                "node_config": {},
                "max_workers": 0,
            },
            "gpu_worker": {
                "resources": resources,
                "node_config": {},
                "min_workers": gpu_worker["min_workers"],
                "max_workers": 2,
            },
        },
        "head_node_type": "ray.head.default",
        **{key: {} for key in EMPTY_KEYS},
        **{key: [] for key in EMPTY_LISTS},
        "file_mounts_sync_continuously": False,
    }


@pytest.fixture
def autoscaling_cluster(tmp_path, monkeypatch):
    """GCS address of a fake autoscaling cluster with only its head up; stopped by pid afterwards."""
    import ray
    from ray._private.services import get_node_ip_address

    ray.shutdown()
    ray_tmp = tempfile.mkdtemp(prefix="hg-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    gcs_address = f"{get_node_ip_address()}:{port}"
    config = tmp_path / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(gcs_address)))
    # The head and this process (the driver) must agree on token authentication. An earlier local ray.init in this
    # process turned it on here (RAY_AUTH_MODE=token, the token in ~/.ray/auth_token): the head then uses the same.
    # Otherwise both run without it (a head that finds ~/.ray/auth_token would require a token this client lacks).
    mode = os.environ.get("RAY_AUTH_MODE") or "disabled"
    monkeypatch.setenv("RAY_AUTH_MODE", mode)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=0",
            "--block",
            f"--autoscaling-config={config}",
            "--dashboard-host=127.0.0.1",
            "--disable-usage-stats",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield gcs_address
    finally:
        ray.shutdown()
        head.send_signal(signal.SIGTERM)  # its children follow
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the session this test started, nothing else
            head.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _worker_nodes(alive: bool) -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Resources"].get("gpu_worker_node") and n["Alive"] == alive]


def test_autoscaling_cluster_launches_nodes_for_pending_workers_and_lets_them_go(
    autoscaling_cluster, checkpoint_dir, dataset, tmp_path
):
    import ray

    deadline = time.monotonic() + 90
    while True:  # `ray start` returns before the GCS answers
        try:
            ray.init(address=autoscaling_cluster, log_to_driver=False)
            break
        except ConnectionError:
            assert time.monotonic() < deadline, "the head did not come up"
            time.sleep(1.0)
    assert ray.cluster_resources().get("CPU", 0) == 0 and not _worker_nodes(alive=True)  # the head alone
    config = job_config(
        checkpoint_dir("granite_moe"),
        dataset,
        tmp_path / "out",
        device="cpu",
        accelerator_type="L40S",
        worker_resources={"gpu_worker_node": 1},
        ray_address=autoscaling_cluster,
        worker_startup_timeout_s=240.0,
    )
    totals = run(build_generate_job(config))
    assert totals["rows"] == NUM_ROWS
    assert [row["id"] for row in read_output(tmp_path / "out")] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    launched = _worker_nodes(alive=True) + _worker_nodes(alive=False)
    assert 1 <= len(launched) <= 2  # launched for the 2 pending workers, at most the node type's max_workers
    assert all(node["Resources"].get("accelerator_type:L40S") == 1 for node in launched)
    deadline = time.monotonic() + 120
    while _worker_nodes(alive=True):  # idle_timeout_minutes 0.1 after the queue drained and workers were released
        assert time.monotonic() < deadline, f"{len(_worker_nodes(alive=True))} worker nodes still up"
        time.sleep(1.0)
    assert [n for n in ray.nodes() if n["Alive"]] and all(
        not n["Resources"].get("gpu_worker_node") for n in ray.nodes() if n["Alive"]
    )
