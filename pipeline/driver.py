"""The driver: connect to Ray, keep a fleet of worker actors busy with shards, write each shard as it arrives.

The only pipeline module that imports ray. Scheduling is a `ray.wait` loop over a dict ref → (kind, actor, shard):
a worker that dies (actor died or unavailable, node lost, spot preemption) sends its shard back to the queue and
is replaced; a shard that keeps failing ends the job with a message naming it. Actors are requested up to
--max-workers (pending actors let the cluster launcher add GPU nodes) and released as soon as the queue drains.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections import Counter, deque
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from tqdm import tqdm

from pipeline.job import Job
from pipeline.manifest import finalize_output, prepare_output
from pipeline.output import OutputDir
from pipeline.sharding import Shard
from workers.actor import FAULT_INJECTION_ENV, ShardTask, ShardWorker


class JobFailed(RuntimeError):
    """The job could not finish (a shard kept failing, or no worker could start)."""


def connect(address: str = "auto") -> None:
    """Join the cluster this job was submitted to (or one running here); else start a local Ray.

    A local Ray started here runs no dashboard; clusters we ship bind theirs to 127.0.0.1.
    """
    if ray.is_initialized():
        return
    local = dict(include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=False)
    if address == "local":
        ray.init(**local)
    elif address != "auto" or os.environ.get("RAY_ADDRESS"):
        ray.init(address=None if address == "auto" else address, log_to_driver=False)
    else:
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError:
            ray.init(**local)


class Fleet:
    """Starts, tracks and releases worker actors."""

    def __init__(self, job: Job, num_workers: int):
        resources = ray.cluster_resources()
        use_gpu = job.worker.device == "cuda" or (job.worker.device == "auto" and resources.get("GPU", 0) > 0)
        if use_gpu:
            options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1}
            spec = dataclasses.replace(job.worker, device="cuda")
        else:
            cpus = max(1, int(resources.get("CPU", 1)) // num_workers)
            options = {"num_cpus": cpus}
            spec = dataclasses.replace(job.worker, device="cpu", num_threads=cpus)
        if FAULT_INJECTION_ENV in os.environ:  # crash tests: hand the hook to the workers
            options["runtime_env"] = {"env_vars": {FAULT_INJECTION_ENV: os.environ[FAULT_INJECTION_ENV]}}
        self.use_gpu, self.spec = use_gpu, spec
        self.actor_class = ray.remote(ShardWorker).options(max_restarts=0, max_task_retries=0, **options)

    def start(self) -> Any:
        """A new actor (it may stay pending until the cluster has room for it)."""
        return self.actor_class.remote(self.spec)

    def request(self, num_workers: int) -> None:
        """Tell the autoscaler how many GPU workers we want (a no-op without an autoscaler)."""
        if self.use_gpu:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[{"GPU": 1}] * num_workers)

    @staticmethod
    def release(actor: Any) -> None:
        """Stop an actor so its node can scale down."""
        ray.kill(actor, no_restart=True)


class ShardLoop:
    """Hands shards to ready actors, writes results as they come back, replaces dead workers."""

    def __init__(self, job: Job, out: OutputDir, todo: list[Shard], progress: tqdm):
        self.job, self.out, self.progress = job, out, progress
        low, high = job.scaling.worker_range
        self.num_workers = min(high, len(todo))
        self.min_ready = min(low, self.num_workers)
        self.fleet = Fleet(job, self.num_workers)
        self.queue: deque[Shard] = deque(todo)
        self.idle: list[Any] = []
        self.in_flight: dict[Any, tuple[str, Any, Shard | None, Any]] = {}  # ref → (kind, actor, shard, rows)
        self.attempts: Counter[int] = Counter()
        self.num_ready, self.num_written = 0, 0
        self.fleet_requested = False  # an autoscaler request is outstanding
        self.counts = Counter()  # generated tokens, drafts … for the progress bar

    def run(self) -> None:
        """Until every shard is written."""
        self.fleet.request(self.num_workers)
        self.fleet_requested = True
        for _ in range(self.num_workers):
            self._start_worker()
        deadline = time.monotonic() + self.job.scaling.worker_startup_timeout_s
        while self.queue or any(kind == "shard" for kind, *_ in self.in_flight.values()):
            self._dispatch()
            done, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=10.0)
            if done:
                self._collect(done[0])
            elif self.num_ready == 0 and time.monotonic() > deadline:
                kind = "GPU" if self.fleet.use_gpu else "CPU"
                raise JobFailed(f"no worker started within {self.job.scaling.worker_startup_timeout_s:.0f} s "
                                f"({self.num_workers} {kind} workers requested)")  # fmt: skip
        self._release_spare_workers()

    def _start_worker(self) -> None:
        actor = self.fleet.start()
        self.in_flight[actor.ready.remote()] = ("ready", actor, None, None)

    def _dispatch(self) -> None:
        while self.idle and self.queue and self.num_ready >= self.min_ready:
            actor, shard = self.idle.pop(), self.queue.popleft()
            task = ShardTask(shard.index, shard.start, self.job.shard_rows(shard))
            self.in_flight[actor.process.remote(task)] = ("shard", actor, shard, task.rows)
        if not self.queue and (self.idle or self.fleet_requested):
            self._release_spare_workers()

    def _release_spare_workers(self) -> None:
        """Nothing left to hand out: stop idle and still-starting workers so their nodes can go."""
        for actor in self.idle:
            self.fleet.release(actor)
        self.idle = []
        for ref in [r for r, (kind, *_) in self.in_flight.items() if kind == "ready"]:
            self.fleet.release(self.in_flight.pop(ref)[1])
        if self.fleet_requested:
            self.fleet.request(0)
            self.fleet_requested = False

    def _collect(self, ref: Any) -> None:
        kind, actor, shard, rows = self.in_flight.pop(ref)
        try:
            value = ray.get(ref)
        except RayTaskError as error:  # the worker is alive but raised
            if kind == "ready":
                raise JobFailed(f"a worker failed to start: {error}") from error
            self._retry(shard, error)
            self.idle.append(actor)
            return
        except (RayActorError, RayError) as error:  # the worker process or its node is gone
            self.fleet.release(actor)
            if kind == "shard":
                self._retry(shard, error)
            if self.queue or kind == "shard":
                self._start_worker()
            return
        self.idle.append(actor)
        if kind == "ready":
            self.num_ready += 1
            return
        table = self.job.output_table(shard, rows, value)
        info = {"index": shard.index, "start": shard.start, "stop": shard.stop, "rows": table.num_rows,
                "seconds": value.seconds, **value.stats}  # fmt: skip
        self.out.write_table(shard.file_name, table, info)
        self._show(table.num_rows, value.stats)
        self.num_written += 1
        _maybe_kill_driver(self.num_written)

    def _show(self, rows: int, stats: dict[str, float]) -> None:
        self.counts.update({k: v for k, v in stats.items() if isinstance(v, (int, float))})
        elapsed = max(self.progress.format_dict["elapsed"], 1e-9)
        tokens = self.counts["generated_tokens"] or self.counts["scored_tokens"]
        postfix = {"tok/s": f"{tokens / elapsed:.0f}"}
        if self.counts["num_draft_tokens"]:
            postfix["accept"] = f"{self.counts['num_accepted_draft_tokens'] / self.counts['num_draft_tokens']:.2f}"
        self.progress.set_postfix(postfix, refresh=False)
        self.progress.update(rows)

    def _retry(self, shard: Shard, error: Exception) -> None:
        self.attempts[shard.index] += 1
        if self.attempts[shard.index] > self.job.scaling.max_shard_retries:
            raise JobFailed(
                f"shard {shard.index} (rows {shard.start}–{shard.stop - 1}) failed {self.attempts[shard.index]} "
                f"times; last error: {type(error).__name__}: {error}"
            ) from error
        self.queue.appendleft(shard)


def _maybe_kill_driver(num_written: int) -> None:
    """Crash-test hook: {"kill_driver_after_shards": N} in HYBRIDGEN_FAULT_INJECTION kills this driver (SIGKILL)
    right after it has written N shard files."""
    plan = json.loads(os.environ.get(FAULT_INJECTION_ENV) or "{}")
    if plan.get("kill_driver_after_shards") == num_written:
        os.kill(os.getpid(), signal.SIGKILL)


def run(job: Job) -> dict[str, Any]:
    """Run (or resume) a job to completion; returns the manifest totals."""
    out = OutputDir(job.output.output)
    resume = prepare_output(out, job, job.output.overwrite)
    if resume.seed is not None:  # rows sample with seed + row index, whether the seed was given or drawn
        job.worker = dataclasses.replace(job.worker, task_options={**job.worker.task_options, "seed": resume.seed})
    todo = [shard for shard in job.plan if shard.index not in resume.done]
    start = time.perf_counter()
    done_rows = sum(s.num_rows for s in job.plan if s.index in resume.done)
    with tqdm(total=len(job.rows), initial=done_rows, unit="row", desc=job.name, dynamic_ncols=True) as progress:
        if todo:
            connect(job.scaling.ray_address)
            ShardLoop(job, out, todo, progress).run()
    return finalize_output(out, job, time.perf_counter() - start, {shard.index for shard in todo})
