"""The driver: connect to Ray, keep a fleet of worker actors busy with shards, write each shard as it arrives.

The only pipeline module that imports ray. Scheduling is a `ray.wait` loop over a dict ref → (kind, actor, shard):
a worker that dies (actor died or unavailable, node lost, spot preemption) sends its shards back to the queue and
is replaced; so does a worker that is hung — alive but no longer making progress (it reports the forwards its engine
finishes: `pipeline/liveness.py`), or past `--shard-timeout-s` when that is set: it is stopped once, and each shard
it held goes back to the queue once. A shard that raised is retried on another worker when there is one, and a
worker that failed `MAX_WORKER_FAILURES` times is replaced; a shard that keeps failing ends the job with a one-line
message naming it (`pipeline/retry.py` decides). Actors are requested up to --max-workers (pending actors let the
cluster launcher add nodes) and released as soon as the queue drains. Work starts as soon as one worker is ready;
while workers wait for room the driver says what they wait for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter, deque
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from tqdm import tqdm

from pipeline.address import answers, recorded_address
from pipeline.fault_injection import maybe_kill_driver
from pipeline.fit import check_on_cluster
from pipeline.job import Job
from pipeline.liveness import Watch
from pipeline.manifest import finalize_output, open_output, prepare_output
from pipeline.messages import node_ip, one_line
from pipeline.output import OutputDir
from pipeline.placement import autoscaler_in_status, pending_message, plan_placement
from pipeline.progress import ProgressCounts, say
from pipeline.retry import Failure, RetryPolicy
from pipeline.sharding import Shard
from workers.actor import FAULT_INJECTION_ENV, ShardTask, ShardWorker
from workers.stream import SHARDS_PER_WORKER

CONNECT_TIMEOUT_S = 10.0  # how long an address may take to answer before the driver gives up on it
MAX_REPORT_INTERVAL_S = 300.0  # "waiting for workers" lines: first after a third of the startup timeout, then rarer


class JobFailed(RuntimeError):
    """The job could not finish (a shard kept failing, no worker could start, no cluster answered)."""


def connect(address: str = "auto") -> None:
    """Join the cluster this job was submitted to (or one running here); else start a local Ray.

    `auto` tries RAY_ADDRESS (set by `ray job submit`), then the cluster `ray start` last recorded on this machine;
    a recorded address where nothing answers (a head that died uncleanly) is reported and skipped. An explicit
    address that does not answer within CONNECT_TIMEOUT_S fails the job. A local Ray runs no dashboard.
    """
    if ray.is_initialized():
        return
    # address="local": a new Ray even when Ray's temp dir records a cluster (a plain ray.init() would join it).
    local = dict(address="local", include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=False)
    if address == "local":
        ray.init(**local)
        return
    origin = "--ray-address"
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address, origin = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    elif address == "auto":
        from ray._common.utils import get_ray_address_file

        record = get_ray_address_file(None)
        address = recorded_address(record)
        if address is not None and not answers(address, timeout_s=2.0):
            say(
                f"note: no Ray cluster answers at {address} (recorded in {record} by an earlier `ray start`; "
                "stale after an unclean stop): starting a local Ray instead"
            )
            address = None
        if address is None:
            ray.init(**local)
            return
    if not answers(address, CONNECT_TIMEOUT_S):
        raise JobFailed(f"no Ray cluster answers at {address} ({origin}) within {CONNECT_TIMEOUT_S:.0f} s")
    ray.init(address=address, log_to_driver=False)


def _alive_nodes() -> list[dict[str, float]]:
    """Each alive node's resource totals."""
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def _autoscaler_running() -> bool:
    """Whether an autoscaler with node types of its own watches this cluster (not Ray's read-only stand-in)."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        return autoscaler_in_status(_internal_kv_get(DEBUG_AUTOSCALING_STATUS))
    except RuntimeError:  # the internal KV is not reachable
        return False


class Fleet:
    """Starts, tracks and releases worker actors."""

    def __init__(self, job: Job, num_workers: int):
        engine = job.worker.engine
        self.placement = plan_placement(
            engine.load.device, job.scaling, _alive_nodes(), num_workers, engine.cache.max_memory
        )
        options: dict[str, Any] = self.placement.actor_options()
        if FAULT_INJECTION_ENV in os.environ:  # crash tests: hand the hook to the workers
            options["runtime_env"] = {"env_vars": {FAULT_INJECTION_ENV: os.environ[FAULT_INJECTION_ENV]}}
        engine = engine.replace(
            device=self.placement.device,
            num_threads=self.placement.num_threads,
            max_memory=self.placement.rank_memory or engine.cache.max_memory,  # the group's memory, per rank
        )
        self.spec = dataclasses.replace(job.worker, engine=engine)
        # A threaded actor: its SHARDS_PER_WORKER shards in flight stream through one engine (workers/stream.py);
        # progress polls have a thread of their own, so they never wait behind shards.
        remote = ray.remote(concurrency_groups={"progress": 1})(ShardWorker)
        concurrency = SHARDS_PER_WORKER + 1
        self.actor_class = remote.options(max_restarts=0, max_task_retries=0, max_concurrency=concurrency, **options)

    def start(self) -> Any:
        """A new actor (it may stay pending until the cluster has room for it)."""
        return self.actor_class.remote(self.spec)

    @staticmethod
    def progress(actor: Any) -> Any:
        """A ref to the worker's heartbeat report (`ShardWorker.progress`)."""
        return actor.progress.options(concurrency_group="progress").remote()

    def request(self, num_workers: int) -> None:
        """Tell the autoscaler how many workers we want (a no-op without an autoscaler)."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[self.placement.bundle] * num_workers)

    def why_pending(self, num_pending: int) -> str:
        """What `num_pending` workers wait for, in one line."""
        return pending_message(num_pending, self.placement.bundle, _alive_nodes(), _autoscaler_running())

    @staticmethod
    def release(actor: Any) -> None:
        """Stop an actor so its node can scale down."""
        ray.kill(actor, no_restart=True)


class ShardLoop:
    """Hands shards to ready actors, writes results as they come back, replaces dead, hung and broken workers."""

    def __init__(self, job: Job, out: OutputDir, todo: list[Shard], progress: tqdm):
        self.job, self.out, self.progress = job, out, progress
        self.num_workers = min(job.scaling.worker_range[1], len(todo))  # never more workers than shards
        self.fleet = Fleet(job, self.num_workers)
        if job.fit is not None and self.fleet.placement.device == "cuda":  # the GPU types are known only now
            skipped = check_on_cluster(job.fit, _alive_nodes())
            if skipped:
                say(skipped)
        self.queue: deque[Shard] = deque(todo)
        self.ready: set[Any] = set()  # workers alive and ready now, idle or busy
        self.load: Counter[Any] = Counter()  # ready worker → shards it holds (at most SHARDS_PER_WORKER)
        # ref → (kind, actor, shard, rows, started): started is when the shard was handed out (or the worker started)
        self.in_flight: dict[Any, tuple[str, Any, Shard | None, Any, float]] = {}
        self.retries = RetryPolicy(job.scaling.max_shard_retries)
        max_tokens = job.worker.sampling.max_tokens if job.worker.sampling is not None else 0
        rows_per_batch = max(1, job.worker.max_num_seqs // job.samples_per_row)  # a row takes --n sequences
        self.watch = Watch(job.scaling.shard_timeout_s, rows_per_batch, max_tokens)  # hung workers
        self.num_start_failures = 0
        self.written: dict[int, dict[str, Any]] = {}  # shard index → the stats written into its file
        self.idle_since, self.had_workers = time.monotonic(), False  # when the fleet last had no ready worker
        self.fleet_requested = False  # an autoscaler request is outstanding
        self.counts = ProgressCounts()  # generated tokens, drafts … for the progress bar

    def run(self) -> None:
        """Until every shard is written. Work starts as soon as one worker is ready."""
        self.fleet.request(self.num_workers)
        self.fleet_requested = True
        for _ in range(self.num_workers):
            self._start_worker()
        timeout = self.job.scaling.worker_startup_timeout_s
        interval = min(timeout / 3, MAX_REPORT_INTERVAL_S)
        next_report = time.monotonic() + interval
        while self.queue or any(kind == "shard" for kind, *_ in self.in_flight.values()):
            self._watch()
            self._dispatch()
            done, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=self._wait_s(min(10.0, interval / 2)))
            if done:
                self._collect(done[0])
                continue
            num_pending = sum(kind == "ready" for kind, *_ in self.in_flight.values())
            now = time.monotonic()
            if not self.ready and now > self.idle_since + timeout:
                what = "replaced the lost ones" if self.had_workers else "started"
                raise JobFailed(f"no worker {what} within {timeout:g} s: {self.fleet.why_pending(num_pending)}")
            if num_pending and now > next_report:
                say(f"waiting for workers ({len(self.ready)} ready): {self.fleet.why_pending(num_pending)}")
                interval = min(2 * interval, MAX_REPORT_INTERVAL_S)
                next_report = now + interval
        self._release_spare_workers()

    def _start_worker(self) -> None:
        actor = self.fleet.start()
        self.in_flight[actor.ready.remote()] = ("ready", actor, None, None, time.monotonic())

    def _dispatch(self) -> None:
        """Fill every ready worker up to SHARDS_PER_WORKER, the least loaded first (every worker gets a shard before
        any gets a second). A worker takes the first queued shard it may run (not one that failed on it while another
        ready worker can take it; that shard waits for one)."""
        for depth in range(1, SHARDS_PER_WORKER + 1):
            for actor in [a for a in self.ready if self.load[a] < depth and a not in self.watch.held_back]:
                position = self.retries.next_shard(actor, [shard.index for shard in self.queue], self.ready)
                if position is None:
                    continue
                shard = self.queue[position]
                del self.queue[position]
                self.load[actor] += 1
                rows = self.job.shard_rows(shard)  # kept here for the output; the worker gets the columns it reads
                task = ShardTask(shard.index, shard.start, rows.select(self.job.worker.input_columns))
                self.in_flight[actor.process.remote(task)] = ("shard", actor, shard, rows, time.monotonic())
        if not self.queue and (self._idle() or self.fleet_requested):
            self._release_spare_workers()

    def _idle(self) -> list[Any]:
        """Ready workers that hold no shard."""
        return [actor for actor in self.ready if self.load[actor] == 0]

    def _wait_s(self, longest: float) -> float:
        """How long `ray.wait` may block: `longest`, or less when a deadline or a progress poll comes sooner."""
        soonest = self.watch.next_check(self._held())
        return longest if soonest is None else min(longest, max(0.0, soonest - time.monotonic()) + 0.05)

    def _held(self) -> dict[Any, list[tuple[Shard, float]]]:
        """Each ready worker's shards, with when each was handed out."""
        held: dict[Any, list[tuple[Shard, float]]] = {actor: [] for actor in self.ready}
        for kind, actor, shard, _, started in self.in_flight.values():
            if kind == "shard" and actor in held:
                held[actor].append((shard, started))
        return held

    def _watch(self) -> None:
        """Stop hung workers (`pipeline/liveness.py` decides), say what is slow, ask busy workers for progress."""
        now = time.monotonic()
        stops, lines = self.watch.check(self._held(), now)
        for line in lines:
            say(line)
        for stop in stops:
            self._stop_worker(stop.worker, stop.charged, TimeoutError(stop.reason))
        polling = {actor for kind, actor, *_ in self.in_flight.values() if kind == "progress"}
        for actor in self.watch.to_poll(self._held(), polling, now):
            self.in_flight[self.fleet.progress(actor)] = ("progress", actor, None, None, now)

    def _stop_worker(self, actor: Any, charged: frozenset[int] = frozenset(), error: Exception | None = None) -> None:
        """Stop a hung or broken worker, once, and start another; each shard it held is requeued once: those in
        `charged` as a retry failed by `error`, the others without one (they did not fail)."""
        self._remove_worker(actor)
        for ref, (kind, holder, shard, *_) in list(self.in_flight.items()):
            if kind == "shard" and holder is actor:
                del self.in_flight[ref]
                if shard.index in charged:
                    self._retry(shard, error, None)
                else:
                    say(f"shard {shard.index} requeued (no retry used): its worker was stopped")
                    self.queue.appendleft(shard)
        self._start_worker()

    def _remove_worker(self, actor: Any) -> None:
        """Stop a worker and forget it; with no ready worker left the startup timeout applies again, from now."""
        self.fleet.release(actor)
        self.retries.forget_worker(actor)
        self.load.pop(actor, None)
        self.watch.forget(actor)
        if actor in self.ready:
            self.ready.discard(actor)
            if not self.ready:
                self.idle_since = time.monotonic()

    def _release_spare_workers(self) -> None:
        """Nothing left to hand out: stop idle and still-starting workers so their nodes can go."""
        for actor in self._idle():
            self.fleet.release(actor)
            self.ready.discard(actor)
            self.load.pop(actor, None)
            self.watch.forget(actor)
        for ref in [r for r, (kind, *_) in self.in_flight.items() if kind == "ready"]:
            self.fleet.release(self.in_flight.pop(ref)[1])
        if self.fleet_requested:
            self.fleet.request(0)
            self.fleet_requested = False

    def _collect(self, ref: Any) -> None:
        kind, actor, shard, rows, started = self.in_flight.pop(ref)
        if kind == "progress":  # a heartbeat report (a worker that died says so through its shards)
            with contextlib.suppress(RayError):
                self.watch.report(actor, ray.get(ref), time.monotonic())
            return
        try:
            value = ray.get(ref)
        except RayTaskError as error:  # the worker is alive but raised
            if kind == "ready":
                self.fleet.release(actor)
                return self._start_failed(one_line(error.cause or error), "?")
            self.load[actor] -= 1
            if self._retry(shard, error, actor).replace_worker and actor in self.ready:
                say(f"a worker failed {self.retries.max_worker_failures} times: replacing it")
                self._stop_worker(actor)
            return
        except (RayActorError, RayError) as error:  # the worker process or its node is gone
            known = actor in self.ready or kind == "ready"  # its other shards' errors arrive later: one replacement
            self._remove_worker(actor)
            preempted = getattr(error, "preempted", False)
            if kind == "ready" and not preempted:  # it died while loading its model
                return self._start_failed(one_line(error), node_ip(error))
            if kind == "shard":
                self._lost_worker(shard, error, preempted)
            if known and (self.queue or kind == "shard"):
                self._start_worker()
            return
        if kind == "ready":
            if "error" in value:
                self.fleet.release(actor)
                return self._start_failed(value["error"], value["node"])
            self.ready.add(actor)
            self.had_workers = True
            return
        self.load[actor] -= 1
        self.watch.deadlines.observe(shard.num_rows, time.monotonic() - started)
        table = self.job.output_table(shard, rows, value)
        info = {"index": shard.index, "start": shard.start, "stop": shard.stop, "rows": table.num_rows,
                "seconds": value.seconds, **value.stats}  # fmt: skip
        try:
            self.out.write_table(shard.file_name, table, info)
        except OSError as error:  # full disk, lost credentials …: what is written stays; a rerun resumes
            raise JobFailed(
                f"writing {shard.file_name} to {self.out.uri} failed ({type(error).__name__}: {error}); "
                f"the {len(self.written)} shard files written by this run are kept: rerun the same "
                "command to resume"
            ) from error
        self.counts.show(self.progress, shard.num_rows, value.stats)  # input rows (a row has --n output rows)
        self.written[shard.index] = info
        maybe_kill_driver(len(self.written))

    def _lost_worker(self, shard: Shard, error: Exception, preempted: bool) -> None:
        """A ready worker died while it held `shard`: requeue the shard (a preemption uses up no retry)."""
        if preempted:  # a spot reclaim: not the shard's fault
            say(f"shard {shard.index} requeued: its worker's node was preempted")
            self.queue.appendleft(shard)
        else:
            self._retry(shard, error, None)

    def _start_failed(self, error: str, node: str) -> None:
        """Print a worker's start failure; fail the job at --max-worker-start-failures, else start another."""
        self.num_start_failures += 1
        limit = self.job.scaling.max_worker_start_failures
        line = f"a worker failed to start on node {node}: {error}"
        if self.num_start_failures >= limit:
            raise JobFailed(
                f"{self.num_start_failures} workers failed to start (--max-worker-start-failures "
                f"{limit}); the last: {line}"
            )
        say(f"{line} ({self.num_start_failures} of at most {limit}; starting another)")
        if self.queue:
            self._start_worker()

    def _retry(self, shard: Shard, error: Exception, actor: Any | None) -> Failure:
        """Requeue `shard` after it failed on `actor` (None: a worker that is gone or was stopped), or fail the job.
        The shards one failed step failed (same `failure_id`) count as one failure of their worker."""
        cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
        failure = self.retries.shard_failed(shard.index, actor, getattr(cause, "failure_id", None))
        where, retries = (
            f"shard {shard.index} (rows {shard.start}–{shard.stop - 1})",
            self.job.scaling.max_shard_retries,
        )
        if not failure.retry:
            raise JobFailed(f"{where} failed {failure.attempts} times; last error: {one_line(cause)}") from error
        say(f"shard {shard.index} requeued ({failure.attempts} of at most {retries} retries): {one_line(cause)}")
        self.queue.appendleft(shard)
        return failure


def run(job: Job) -> dict[str, Any]:
    """Run (or resume) a job to completion; returns the manifest totals."""
    out, lock = open_output(job)
    with lock:
        resume = prepare_output(out, job, job.output.overwrite)
        if resume.seed is not None:  # rows sample with seed + row index, whether the seed was given or drawn
            sampling = dataclasses.replace(job.worker.sampling, seed=resume.seed)
            job.worker = dataclasses.replace(job.worker, sampling=sampling)
        todo = [shard for shard in job.plan if shard.index not in resume.done]
        start = time.perf_counter()
        done_rows = sum(s.num_rows for s in job.plan if s.index in resume.done)
        written: dict[int, dict[str, Any]] = {}
        with tqdm(total=len(job.rows), initial=done_rows, unit="row", desc=job.name, dynamic_ncols=True) as progress:
            if todo:
                connect(job.scaling.ray_address)
                loop = ShardLoop(job, out, todo, progress)
                loop.run()
                written = loop.written
        return finalize_output(out, job, time.perf_counter() - start, written)
