"""Tensor-parallel workers on the driver side, without a cluster: one bundle of T ranks, what a pending group waits
for, the flags reaching the workers' engine config, the actor's rank watch and its fault hook."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pytest

import pipeline.driver
import workers.actor
from jobs.generate import SECTIONS
from pipeline.cli import parse_sections
from pipeline.config import ScalingConfig
from pipeline.generate import build_generate_job
from pipeline.job import worker_spec
from pipeline.placement import pending_message, plan_placement
from tests.pipeline.conftest import job_config
from workers.actor import FAULT_INJECTION_ENV, ShardTask, ShardWorker, WorkerSpec
from workers.config import EngineConfig
from workers.model.distributed.group import RankFailure

GiB = 2**30
BASE = ["--model", "m", "--input", "d.jsonl", "--prompt-column", "text"]


def test_a_gpu_worker_of_two_ranks_is_one_bundle_of_two_gpus():
    gpu_node = {"CPU": 16.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
    placement = plan_placement("auto", ScalingConfig(tensor_parallel_size=2), [gpu_node], 2)
    assert placement.device == "cuda"
    assert placement.bundle == {"CPU": 2, "GPU": 2}
    assert placement.actor_options() == {"num_cpus": 2, "num_gpus": 2}
    scaling = ScalingConfig(tensor_parallel_size=2, cpus_per_worker=3, accelerator_type="H100")
    placement = plan_placement("cuda", scaling, [], 1)  # --cpus-per-worker is per rank
    assert placement.bundle == {"CPU": 6, "GPU": 2, "accelerator_type:H100": 0.001}


def test_a_cpu_worker_of_two_ranks_asks_for_both_ranks_cpus_and_memory():
    node = {"CPU": 8.0, "memory": 16.0 * GiB}
    placement = plan_placement("cpu", ScalingConfig(tensor_parallel_size=2), [node], 2)
    # Two workers of two ranks on 8 CPUs: 2 CPUs (threads) per rank, 4 per worker; the node's memory split in two.
    assert (placement.num_cpus, placement.num_threads, placement.num_gpus) == (4, 2, 0)
    assert placement.memory == 8 * GiB
    assert placement.bundle == {"CPU": 4, "memory": 8 * GiB}
    assert placement.rank_memory == 4 * GiB  # each rank's engine plans within its share
    one = plan_placement("cpu", ScalingConfig(tensor_parallel_size=2), [node], 1)
    assert (one.num_cpus, one.num_threads, one.memory) == (8, 4, 16 * GiB)
    assert plan_placement("cpu", ScalingConfig(tensor_parallel_size=2), [], 3).num_cpus == 2  # no node up yet


def test_a_group_no_node_can_hold_names_its_bundle():
    placement = plan_placement("cuda", ScalingConfig(tensor_parallel_size=2), [], 2)
    one_gpu_nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    message = pending_message(2, placement.bundle, one_gpu_nodes, autoscaler=False)
    assert message.startswith("2 workers need {CPU: 2, GPU: 2}: no node has GPU ≥ 2 (cluster total 2)")


def test_the_parallel_flags_reach_the_engine_config():
    sections = parse_sections("t", SECTIONS, [*BASE, "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert sections["scaling"].tensor_parallel_size == 2 and sections["scaling"].enable_expert_parallel
    engine = worker_spec("generate", sections["model"], scaling=sections["scaling"]).engine
    assert (engine.parallel.tensor_parallel_size, engine.parallel.enable_expert_parallel) == (2, True)
    # The driver's per-placement changes keep them.
    engine = engine.replace(device="cuda", num_threads=3)
    assert (engine.parallel.tensor_parallel_size, engine.parallel.num_threads) == (2, 3)
    plain = worker_spec("generate", parse_sections("t", SECTIONS, BASE)["model"]).engine
    assert (plain.parallel.tensor_parallel_size, plain.parallel.enable_expert_parallel) == (1, False)


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setattr(pipeline.driver, "connect", lambda address: pytest.fail("the job reached Ray"))


def test_the_layout_is_not_part_of_the_resume_fingerprint(checkpoint_dir, dataset, tmp_path, no_ray):
    model = checkpoint_dir("qwen3_next")
    one = build_generate_job(job_config(model, dataset, tmp_path / "out"))
    two = build_generate_job(job_config(model, dataset, tmp_path / "out", tensor_parallel_size=2))
    assert isinstance(two.config, dict) and two.config["scaling"]["tensor_parallel_size"] == 2  # in the manifest
    assert one.fingerprint == two.fingerprint
    assert two.worker.engine.parallel.tensor_parallel_size == 2


class FakeRunner:
    """Records the tensor-parallel calls the actor makes on its runner."""

    tokenizer = object()
    device = "cpu"

    def __init__(self) -> None:
        self.watchers: list = []
        self.killed: list[int] = []

    def step(self) -> list:
        return []

    def watch_ranks(self, on_failure) -> None:
        self.watchers.append(on_failure)

    def kill_rank(self, rank: int) -> None:
        self.killed.append(rank)


def _worker(monkeypatch, size: int) -> ShardWorker:
    monkeypatch.setattr(workers.actor.ModelRunner, "from_pretrained", staticmethod(lambda *_: FakeRunner()))
    engine = EngineConfig().replace(tensor_parallel_size=size)
    worker = ShardWorker(WorkerSpec("generate", "m", engine))
    assert worker.start_error is None, worker.start_error
    return worker


def test_a_tensor_parallel_worker_watches_its_ranks_and_dies_with_them(monkeypatch):
    assert _worker(monkeypatch, 1).runner.watchers == []
    assert _worker(monkeypatch, 2).runner.watchers == [workers.actor.die]


def test_die_kills_the_worker_process():
    pid = os.fork()
    if pid == 0:  # the child: die must not return
        try:
            workers.actor.die("rank 1 is gone")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_rank_failure_in_a_shard_kills_the_worker_instead_of_retrying(monkeypatch):
    worker = _worker(monkeypatch, 2)
    died: list[str] = []

    def record(reason: str) -> None:
        died.append(reason)
        raise SystemExit  # stands in for SIGKILL: nothing after it may run

    def lose_a_rank(task):
        raise RankFailure("rank 1 died")

    monkeypatch.setattr(workers.actor, "die", record)
    monkeypatch.setattr(worker, "_process", lose_a_rank)
    with pytest.raises(SystemExit):
        worker.process(ShardTask(0, 0, pa.table({"text": ["a"]})))
    assert died == ["RankFailure: rank 1 died"]


def test_kill_rank_during_shard_kills_the_named_rank_once(monkeypatch, tmp_path: Path):
    worker = _worker(monkeypatch, 2)
    marker = tmp_path / "marker"
    monkeypatch.setenv(FAULT_INJECTION_ENV, json.dumps({"kill_rank_during_shard": 3, "marker": str(marker)}))
    rows = pa.table({"text": ["a"]})
    worker._maybe_inject_fault(ShardTask(2, 0, rows))
    assert worker.runner.killed == []
    worker._maybe_inject_fault(ShardTask(3, 0, rows))
    assert worker.runner.killed == [1] and marker.exists()
    worker._maybe_inject_fault(ShardTask(3, 0, rows))  # the retried shard runs on
    assert worker.runner.killed == [1]


def test_a_score_job_carries_the_layout_and_is_refused_when_it_does_not_split(
    checkpoint_dir, dataset, tmp_path, no_ray
):
    from pipeline.config import ModelConfig, OutputConfig
    from pipeline.score import build_score_job
    from pipeline.score_config import ScoreInputConfig, ScoreJobConfig

    def config(size: int) -> ScoreJobConfig:
        return ScoreJobConfig(
            input=ScoreInputConfig(input=str(dataset), text_column="text", id_column="key"),
            model=ModelConfig(model=str(checkpoint_dir("qwen3_next")), max_model_len=64),
            scaling=ScalingConfig(tensor_parallel_size=size, enable_expert_parallel=True),
            output=OutputConfig(output=str(tmp_path / "out")),
        )

    engine = build_score_job(config(2)).worker.engine
    assert (engine.parallel.tensor_parallel_size, engine.parallel.enable_expert_parallel) == (2, True)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: tensor_parallel_size=3 does not divide"):
        build_score_job(config(3))
