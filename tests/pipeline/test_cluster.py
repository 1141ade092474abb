"""A real multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): a head with no CPUs and two 2-CPU
worker nodes. CPU workers sized to a node, a worker node killed mid-shard, a node drained for preemption.

Ray's temp dir is private to this module (RAY_TMPDIR), so the cluster address it records and clears is ours alone.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pipeline.driver import run
from pipeline.generate import build_generate_job
from tests.pipeline.conftest import NUM_ROWS, job_config, read_output

pytestmark = pytest.mark.slow
NODE_CPUS = 2


@pytest.fixture(scope="module")
def cluster():
    """Head (0 CPUs: it runs the driver only) + two worker nodes; shut down (our processes only) at the end."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    ray_tmp = tempfile.mkdtemp(prefix="hg-", dir="/tmp")
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_TMPDIR", ray_tmp)
    patch.delenv("RAY_ADDRESS", raising=False)
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        patch.undo()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _keep_two_worker_nodes(cluster) -> None:
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()


@pytest.fixture(scope="module")
def undisturbed(cluster, checkpoint_dir, dataset, tmp_path_factory) -> list[dict]:
    """One worker on two 2-CPU nodes: it must ask for 2 CPUs (what a node holds), not 4 (the cluster's total)."""
    output = tmp_path_factory.mktemp("undisturbed")
    config = job_config(
        checkpoint_dir("granite_moe"), dataset, output, num_workers=1, ray_address="auto", worker_startup_timeout_s=60.0
    )
    run(build_generate_job(config))
    rows = read_output(output)
    assert [row["id"] for row in rows] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    return rows


def test_one_cpu_worker_fits_on_a_node(undisturbed):
    assert len(undisturbed) == NUM_ROWS  # before: 1 worker × 4 CPUs, never placed, failed after the startup timeout


def _run_in_thread(config) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target():
        try:
            outcome["totals"] = run(build_generate_job(config))
        except BaseException as error:  # reported by the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _node_running_the_hung_shard(cluster, marker: Path, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < deadline, "no worker reached the shard that hangs"
        time.sleep(0.2)
    node_id = marker.read_text()
    return next(node for node in cluster.worker_nodes if node.node_id == node_id)


def _disturbed_run(cluster, checkpoint_dir, dataset, tmp_path, monkeypatch, take_node_away, **overrides):
    _keep_two_worker_nodes(cluster)
    marker = tmp_path / "hung"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", f'{{"hang_during_shard": 2, "marker": "{marker}"}}')
    config = job_config(checkpoint_dir("granite_moe"), dataset, tmp_path / "out", ray_address="auto", **overrides)
    thread, outcome = _run_in_thread(config)
    take_node_away(_node_running_the_hung_shard(cluster, marker))
    thread.join(timeout=240)
    assert not thread.is_alive(), "the job did not finish after its node went away"
    assert "error" not in outcome, outcome.get("error")
    return read_output(tmp_path / "out")


def test_worker_node_killed_mid_shard(cluster, checkpoint_dir, dataset, tmp_path, monkeypatch, undisturbed, capfd):
    def kill(node):
        cluster.remove_node(node, allow_graceful=False)

    assert _disturbed_run(cluster, checkpoint_dir, dataset, tmp_path, monkeypatch, kill) == undisturbed
    assert "shard 2 requeued (1 of at most 3 retries)" in capfd.readouterr().err


def test_node_drained_for_preemption(cluster, checkpoint_dir, dataset, tmp_path, monkeypatch, undisturbed, capfd):
    import ray
    from ray.core.generated import autoscaler_pb2

    def preempt(node):
        gcs = ray._raylet.GcsClient(address=cluster.address)
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        deadline_ms = (time.time_ns() // 1_000_000) + 1_000
        accepted, rejection = gcs.drain_node(node.node_id, reason, "spot instance reclaimed (test)", deadline_ms)
        assert accepted, rejection
        time.sleep(1.0)
        cluster.remove_node(node, allow_graceful=False)  # the cloud takes the node at the deadline

    # With no retries allowed, the job completes only if a preempted shard is requeued without using one.
    output = _disturbed_run(cluster, checkpoint_dir, dataset, tmp_path, monkeypatch, preempt, max_shard_retries=0)
    assert output == undisturbed
    assert "shard 2 requeued: its worker's node was preempted" in capfd.readouterr().err
