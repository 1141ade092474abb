"""Where workers go, without a cluster: CPU sizing, resource flags, what a pending worker waits for."""

from __future__ import annotations

import json

import pytest

from jobs.generate import SECTIONS
from pipeline.cli import parse_sections
from pipeline.config import ScalingConfig
from pipeline.placement import autoscaler_in_status, fitting_cpus, pending_message, plan_placement

BASE = ["--model", "m", "--input", "d.jsonl", "--prompt-column", "text"]
HEAD = {"CPU": 0.0, "memory": 1e9}


def test_cpu_workers_are_sized_by_what_a_node_holds():
    # Two 8-CPU nodes, one worker: 8 CPUs (a cluster-wide division asks for 16, which no node has).
    assert fitting_cpus([8, 8], 1) == 8
    assert fitting_cpus([8, 8], 2) == 8
    assert fitting_cpus([8, 8], 3) == 4  # 2 + 2 workers of 4 fit; of 5 only 1 + 1
    assert fitting_cpus([8, 2], 2) == 4
    assert fitting_cpus([2], 2) == 1
    assert fitting_cpus([2], 3) == 1  # more workers than CPUs: 1 each, the rest wait
    assert fitting_cpus([], 4) == 1  # autoscaling cluster with no worker node yet
    placement = plan_placement("auto", ScalingConfig(), [HEAD, {"CPU": 8.0}, {"CPU": 8.0}], 1)
    assert (placement.device, placement.num_cpus, placement.num_threads) == ("cpu", 8, 8)
    assert placement.actor_options() == {"num_cpus": 8, "num_gpus": 0}


def test_cpus_per_worker_flag_wins():
    placement = plan_placement("cpu", ScalingConfig(cpus_per_worker=3), [{"CPU": 8.0}], 1)
    assert (placement.num_cpus, placement.num_threads) == (3, 3)


def test_gpu_workers_and_placement_flags_reach_options_and_bundle():
    scaling = ScalingConfig(worker_resources={"spot_node": 1}, accelerator_type="L4")
    gpu_node = {"CPU": 8.0, "GPU": 1.0, "spot_node": 1.0, "accelerator_type:L4": 1.0}
    placement = plan_placement("auto", scaling, [HEAD, gpu_node], 2)
    assert placement.device == "cuda" and placement.num_threads is None
    assert placement.actor_options() == {
        "num_cpus": 1,
        "num_gpus": 1,
        "resources": {"spot_node": 1, "accelerator_type:L4": 0.001},
    }
    assert placement.bundle == {"CPU": 1, "GPU": 1, "spot_node": 1, "accelerator_type:L4": 0.001}
    # CPU workers pinned to a node type: sized by the nodes that have the resource, not the others.
    cpu = plan_placement("cpu", ScalingConfig(worker_resources={"spot_node": 1}), [{"CPU": 32.0}, gpu_node], 1)
    assert (cpu.num_cpus, cpu.bundle) == (8, {"CPU": 8, "spot_node": 1})


def test_pending_message_names_what_is_missing():
    bundle = {"CPU": 1, "GPU": 1}
    assert pending_message(2, bundle, [{"CPU": 2.0}], autoscaler=False) == (
        "2 workers need {CPU: 1, GPU: 1}: no node has GPU ≥ 1 (cluster total 0), and no autoscaler is running to add "
        "nodes"
    )
    assert pending_message(1, {"CPU": 1}, [{"CPU": 2.0}], autoscaler=True) == (
        "1 worker needs {CPU: 1}: the nodes that can hold one are busy, and the autoscaler has been asked for nodes"
    )
    split = pending_message(1, {"CPU": 1, "spot": 1}, [{"CPU": 1.0}, {"spot": 1.0}], autoscaler=False)
    assert "no single node has all of it" in split


def test_placement_flags_parse_and_are_validated():
    sections = parse_sections(
        "t",
        SECTIONS,
        [
            *BASE,
            "--worker-resources",
            '{"spot_node": 1}',
            "--accelerator-type",
            "A100",
            "--cpus-per-worker",
            "4",
            "--max-worker-start-failures",
            "2",
        ],
    )
    scaling = sections["scaling"]
    assert (scaling.worker_resources, scaling.accelerator_type) == ({"spot_node": 1}, "A100")
    assert (scaling.cpus_per_worker, scaling.max_worker_start_failures) == (4, 2)
    with pytest.raises(SystemExit):  # argparse: "invalid JSON object value"
        parse_sections("t", SECTIONS, [*BASE, "--worker-resources", "[1]"])
    for bad, message in [
        (dict(worker_resources={"GPU": 1}), "set by --cpus-per-worker, --device and --accelerator-type"),
        (dict(worker_resources={"spot": -1}), "positive amounts"),
        (dict(accelerator_type="accelerator_type:L4"), "an accelerator name such as L4"),
        (dict(cpus_per_worker=0), "--cpus-per-worker"),
        (dict(max_worker_start_failures=0), "--max-worker-start-failures"),
    ]:
        with pytest.raises(ValueError, match=message):
            ScalingConfig(**bad)


def test_autoscaler_is_told_apart_from_rays_read_only_stand_in():
    real = {"autoscaler_report": {"active_nodes": {"ray.head.default": 1}, "pending_nodes": [], "pending_launches": {}}}
    read_only = {"autoscaler_report": {"active_nodes": {"node_0af3": 1}, "pending_nodes": [], "pending_launches": {}}}
    assert autoscaler_in_status(json.dumps(real).encode()) is True
    assert autoscaler_in_status(json.dumps(read_only)) is False
    assert autoscaler_in_status(None) is False and autoscaler_in_status(b"not json") is False


def test_cpu_workers_split_a_nodes_memory_and_ask_ray_for_their_share():
    gib = 2**30
    node = {"CPU": 8.0, "memory": 16.0 * gib}
    # Two workers of 4 CPUs share the node: each gets half its memory as budget and asks Ray for it.
    placement = plan_placement("cpu", ScalingConfig(), [HEAD, node], 2)
    assert (placement.num_cpus, placement.memory) == (4, 8 * gib)
    assert placement.actor_options() == {"num_cpus": 4, "num_gpus": 0, "memory": 8 * gib}
    assert placement.bundle == {"CPU": 4, "memory": 8 * gib}
    # Never more workers per node than the job has: one 1-CPU worker gets the whole node, three get a third each.
    assert plan_placement("cpu", ScalingConfig(cpus_per_worker=1), [node], 1).memory == 16 * gib
    assert plan_placement("cpu", ScalingConfig(cpus_per_worker=1), [node], 3).memory == 16 * gib // 3
    # Unequal nodes: the smallest share, so that every node holds as many workers as its CPUs allow.
    small = {"CPU": 8.0, "memory": 8.0 * gib}
    assert plan_placement("cpu", ScalingConfig(), [node, small], 4).memory == 4 * gib
    for nodes, num_workers in [([HEAD, node], 2), ([node, small], 4), ([node], 3), ([node], 8)]:
        share = plan_placement("cpu", ScalingConfig(), nodes, num_workers)
        for n in nodes:  # the workers Ray can put on a node (by CPU) fit in its memory together
            assert min(num_workers, n["CPU"] // share.num_cpus) * share.memory <= n["memory"]
    # --max-memory: that budget is what each worker asks of Ray.
    assert plan_placement("cpu", ScalingConfig(), [node], 2, max_memory="3GiB").memory == 3 * gib
    # No node to measure (an autoscaling cluster starting empty) and GPU workers: no memory asked.
    assert plan_placement("cpu", ScalingConfig(), [HEAD], 2).memory is None
    assert "memory" not in plan_placement("cpu", ScalingConfig(), [HEAD], 2).actor_options()
    gpu = plan_placement("cuda", ScalingConfig(), [{**node, "GPU": 1.0}], 2)
    assert gpu.memory is None and "memory" not in gpu.bundle


def test_pending_message_shows_memory_in_gib():
    message = pending_message(1, {"CPU": 1, "memory": 3 * 2**30}, [{"CPU": 2.0, "memory": 2.0 * 2**30}], False)
    assert "1 worker needs {CPU: 1, memory: 3 GiB}: no node has memory ≥ 3 GiB (cluster total 2 GiB)" in message
