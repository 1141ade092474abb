"""The Ray actor: a plain class holding one `ModelRunner`; the driver wraps it with `ray.remote(...)`.

It receives small typed values (a `WorkerSpec` once, then one `ShardTask` per shard) and returns an Arrow table
plus the shard's counters. Calls may overlap (the driver runs it as a threaded actor, shards streaming through one
engine: `workers/stream.py`). Nothing here depends on Ray, so tests build it directly.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import torch

from workers.columns import decode_rows
from workers.config import EngineConfig
from workers.model.distributed.group import RankFailure
from workers.rows import PromptSource, generation_columns, per_result_logprobs, shard_requests
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scoring import ScoreSpec, score_shard
from workers.spec_decode import SpeculativeConfig
from workers.stream import ShardStream

# Test hooks, unset in normal runs: {"kill_during_shard": N, "marker": path} makes the worker kill its own process
# (SIGKILL) while it processes shard N, once (the marker file remembers); {"hang_during_shard": N, "marker": path}
# makes it write its node id into the marker and sleep in shard N, once, so a test can take the node away (or the
# driver's shard deadline kill it); {"break_during_shard": N, "marker": path} makes the first worker that gets
# shard N write its process id into the marker and raise on shard N and on every shard after it, as a worker with
# a broken CUDA context does. On the engine's steps: {"slow_step_s": S} sleeps S seconds before each step (a slow
# CPU worker); {"fail_step": N, "marker": path} makes the Nth step of the first worker to reach it raise once (a
# transient out-of-memory); {"freeze_step": N, "marker": path} makes it never return (a frozen engine). Tensor
# parallel workers: {"kill_rank_during_shard": N, "rank": R, "marker": path} kills rank R (default 1) of the worker
# that processes shard N, once; the rank watch then takes the whole worker down (`die`).
FAULT_INJECTION_ENV = "HYBRIDGEN_FAULT_INJECTION"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to load its model and process shards: the engine config, passed whole to the
    runner, and the task's typed options."""

    task: str  # "generate" | "score"
    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    prompt: PromptSource = field(default_factory=PromptSource)
    sampling: SamplingParams | None = None  # generate: every row's sampling; row i of the dataset uses seed + i
    scoring: ScoreSpec | None = None  # score: which columns are scored and how

    @property
    def input_columns(self) -> list[str]:
        """The input columns a worker reads (the driver sends it only these)."""
        return self.prompt.columns if self.task == "generate" else self.scoring.columns

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The engine's speculative config (None: plain decoding)."""
        return self.engine.speculative

    @property
    def revision(self) -> str | None:
        """The hub commit every worker loads (None: a local directory)."""
        return self.engine.load.revision

    @property
    def enforce_eager(self) -> bool:
        """Whether the workers run every step eagerly, without CUDA graphs (vLLM's name)."""
        return self.engine.execution.cuda_graphs is False

    @property
    def max_num_seqs(self) -> int:
        """Requests each worker decodes together."""
        return self.engine.scheduler.max_num_seqs


@dataclass(frozen=True)
class ShardTask:
    """One shard's input rows (the columns the worker reads)."""

    index: int
    first_row: int  # dataset index of the shard's first row
    rows: pa.Table


@dataclass
class ShardOutput:
    """The new columns for a shard's rows and what it took to make them."""

    index: int
    columns: dict[str, list[Any]]
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)


def shard_stats(columns: dict[str, list[Any]]) -> dict[str, float]:
    """A shard's counters for the manifest, summed over its rows (shards in flight together share the runner, so
    its own counters cannot be split between them)."""
    stats: dict[str, float] = {}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_draft_tokens"):
        if key in columns:
            stats[key] = sum(columns[key])
    if "num_generated_tokens" in columns:
        stats["generated_tokens"] = sum(columns["num_generated_tokens"])
        stats["prompt_tokens"] = sum(columns["num_prompt_tokens"])
    for key in ("num_scored_tokens", "sum_logprob"):
        if key in columns:
            stats[key.replace("num_", "")] = sum(v for v in columns[key] if v is not None)
    return stats


def node_name() -> str:
    """Where this process runs: the Ray node id when inside Ray, and the host name."""
    try:
        import ray

        if ray.is_initialized():
            return f"{ray.get_runtime_context().get_node_id()[:12]} ({socket.gethostname()})"
    except ImportError:
        pass
    return socket.gethostname()


class ShardWorker:
    """Loads the model once, then turns shards of rows into output columns.

    A worker that cannot load its model stays up and says why from `ready()`, so the driver can print the error
    (type, message, node) and decide whether to try another worker; `process` is never called on it.
    """

    def __init__(self, spec: WorkerSpec):
        self.spec, self.runner, self.start_error = spec, None, None
        self.stream = ShardStream()  # its engine thread does every torch call of this worker, loading included
        try:
            self.runner = self.stream.call(lambda: self._load(spec)).result()
            if self.runner.tokenizer is None:
                raise ValueError(f"model {spec.model!r} has no tokenizer files: cannot turn text into tokens")
            _inject_step_faults(self.runner)
            if spec.engine.parallel.tensor_parallel_size > 1:  # a dead rank takes its group down: the driver
                self.runner.watch_ranks(die)  # sees a dead worker, requeues its shards and starts another
            self.stream.runner = self.runner
        except Exception as error:  # reported by ready(); the driver decides
            self.start_error = f"{type(error).__name__}: {error}"

    @staticmethod
    def _load(spec: WorkerSpec) -> ModelRunner:
        """The worker's runner (on the engine thread)."""
        if spec.engine.parallel.num_threads:
            torch.set_num_threads(spec.engine.parallel.num_threads)
        return ModelRunner.from_pretrained(spec.model, spec.engine)

    def ready(self) -> dict[str, Any]:
        """Called once by the driver: where the worker runs, and `error` when it could not load its model."""
        info = {"pid": os.getpid(), "node": node_name()}
        if self.start_error is not None:
            return {**info, "error": self.start_error}
        return {**info, "device": str(self.runner.device)}

    def progress(self) -> dict[str, Any]:
        """Polled by the driver while the worker holds shards (never waits for the engine): the units of work its
        engine has finished and how long they take (`workers/heartbeat.py`)."""
        return self.stream.heartbeat.report()

    def process(self, task: ShardTask) -> ShardOutput:
        """Generate (or score) every row of a shard. Generation streams: the driver keeps more than one shard in
        flight (a threaded actor), and each call's rows join the running batch as slots free up; a row is decoded
        from Arrow and tokenized when the engine has room for it, and a row that cannot be is that row's error."""
        if self.runner is None:
            raise RuntimeError(f"this worker failed to start: {self.start_error}")
        start = time.perf_counter()
        self._maybe_inject_fault(task)
        try:
            columns, stats = self._process(task)
        except RankFailure as error:  # a peer rank is gone: the group cannot go on, and a retry here cannot help
            die(f"{type(error).__name__}: {error}")
        return ShardOutput(task.index, columns, time.perf_counter() - start, stats)

    def _process(self, task: ShardTask) -> tuple[dict[str, list[Any]], dict[str, float]]:
        """The shard's output columns and counters."""
        if self.spec.task == "generate":
            rows = decode_rows(task.rows, self.spec.input_columns)
            sampling = self.spec.sampling
            per_row = None if self.spec.prompt.sampling_params_column is None else []  # rows' own logprobs
            requests = shard_requests(
                self.runner.tokenizer, rows, self.spec.prompt, sampling, task.first_row, row_logprobs=per_row
            )
            num_rows, num_samples = task.rows.num_rows, sampling.n  # one output row per sample, row-major
            results = self.stream.submit(task.index, requests, num_rows, num_samples).result()
            columns = generation_columns(results, per_result_logprobs(sampling, per_row), self.spec.prompt.chat)
            stats = {**shard_stats(columns), "prefix_cache_hit_tokens": sum(r.num_cached_tokens for r in results)}
        else:

            def score() -> dict[str, list[Any]]:  # on the engine thread: its forwards beat the heartbeat
                rows = list(decode_rows(task.rows, self.spec.input_columns))
                return score_shard(self.runner, rows, self.spec.scoring, self.stream.heartbeat.beat)

            columns = self.stream.call(score).result()
            stats = shard_stats(columns)
        return columns, stats

    def _maybe_inject_fault(self, task: ShardTask) -> None:
        plan = os.environ.get(FAULT_INJECTION_ENV)
        if not plan:
            return
        plan = json.loads(plan)
        marker = Path(plan.get("marker", "/nonexistent/marker"))
        if task.index == plan.get("kill_during_shard") and not marker.exists():
            marker.write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)
        if task.index == plan.get("kill_rank_during_shard") and not marker.exists():
            rank = int(plan.get("rank", 1))
            marker.write_text(f"rank {rank} of process {os.getpid()} killed once")
            self.runner.kill_rank(rank)
        if task.index == plan.get("break_during_shard") and not marker.exists():
            marker.write_text(str(os.getpid()))
        if "break_during_shard" in plan and marker.exists() and marker.read_text() == str(os.getpid()):
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected, shard {task.index})")
        if task.index == plan.get("hang_during_shard") and not marker.exists():
            import ray

            partial = marker.with_name(marker.name + ".partial")
            partial.write_text(ray.get_runtime_context().get_node_id())
            partial.rename(marker)
            time.sleep(3600)  # until the test takes this node away


def die(reason: str) -> NoReturn:
    """End this worker's process at once (SIGKILL), as a crashed worker ends: called when a rank of its
    tensor-parallel group died, so that the driver's dead-worker path replaces the whole group and requeues its
    shards (a group missing a rank cannot compute, and no in-process recovery could rebuild it)."""
    print(f"tensor-parallel worker {os.getpid()} stops: {reason}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _inject_step_faults(runner: ModelRunner) -> None:
    """The test hooks on the engine's steps (see FAULT_INJECTION_ENV)."""
    plan = json.loads(os.environ.get(FAULT_INJECTION_ENV) or "{}")
    if not {"slow_step_s", "fail_step", "freeze_step"} & set(plan):
        return
    step, counter, marker = runner.step, itertools.count(1), Path(plan.get("marker", "/nonexistent/marker"))

    def faulty_step() -> list:
        number = next(counter)
        time.sleep(plan.get("slow_step_s", 0))
        if number in (plan.get("fail_step"), plan.get("freeze_step")) and not marker.exists():
            marker.write_text(f"step {number} of process {os.getpid()}")
            if number == plan.get("fail_step"):
                raise RuntimeError(f"CUDA out of memory (injected, step {number})")
            time.sleep(3600)  # frozen until the driver stops this worker
        return step()

    runner.step = faulty_step
