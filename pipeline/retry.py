"""What the driver does about failing shards and workers: pure decisions over plain values, tested without Ray.

`RetryPolicy` counts each shard's failures (ending the job past `--max-shard-retries`), remembers which workers a
shard failed on so that its retry goes elsewhere, and says when a worker has failed often enough to be replaced (a
worker with a broken CUDA context fails every shard it gets; the shards one failed step fails count once).
`ShardDeadline` says how long a shard may take: `--shard-timeout-s`, a hard deadline, or by default a generous
multiple of the time it should take, from what is known — which never stops a worker that still makes progress
(`pipeline/liveness.py` decides that). Workers are any hashable handles; a worker may hold several shards at once.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

MAX_WORKER_FAILURES = 2  # failures (a failed shard, or one failed step of several) before a worker is replaced
MIN_SHARD_TIMEOUT_S = 600.0  # auto deadline: never less than this …
SHARD_TIMEOUT_FACTOR = 10.0  # … nor less than this many times the expected time of the shard


@dataclass(frozen=True)
class Failure:
    """What to do after a shard failed: `retry` it (else the job fails), `replace_worker` (stop it, start another)."""

    retry: bool
    replace_worker: bool
    attempts: int  # failures of this shard so far


@dataclass
class RetryPolicy:
    """Failure counts per shard and per worker, and which shard an idle worker may take next."""

    max_shard_retries: int
    max_worker_failures: int = MAX_WORKER_FAILURES
    attempts: Counter[int] = field(default_factory=Counter)  # shard index → failures
    failed_on: defaultdict[int, set[Hashable]] = field(default_factory=lambda: defaultdict(set))  # shard → workers
    worker_failures: Counter[Hashable] = field(default_factory=Counter)
    events: set[tuple[Hashable, Hashable]] = field(default_factory=set)  # (worker, event) already counted

    def shard_failed(self, shard: int, worker: Hashable | None, event: Hashable | None = None) -> Failure:
        """Record that `shard` failed on `worker` (None: the worker is gone and counts for nothing). `event`: what
        failed, when it failed several shards at once (a step that ran rows of each): the worker's failure counts
        once for all of them."""
        self.attempts[shard] += 1
        replace = False
        if worker is not None:
            self.failed_on[shard].add(worker)
            if event is None or (worker, event) not in self.events:
                self.worker_failures[worker] += 1
            if event is not None:
                self.events.add((worker, event))
            replace = self.worker_failures[worker] >= self.max_worker_failures
        return Failure(self.attempts[shard] <= self.max_shard_retries, replace, self.attempts[shard])

    def may_run(self, shard: int, worker: Hashable, ready_workers: Collection[Hashable]) -> bool:
        """Whether `worker` may take `shard`: it has not failed there, or it failed on every ready worker."""
        tried = self.failed_on.get(shard, set())
        return worker not in tried or all(other in tried for other in ready_workers)

    def next_shard(self, worker: Hashable, queue: Sequence[int], ready_workers: Collection[Hashable]) -> int | None:
        """The position in `queue` of the first shard `worker` may take, or None (it waits; the shards ahead wait
        for another ready worker, which will take them)."""
        return next((i for i, shard in enumerate(queue) if self.may_run(shard, worker, ready_workers)), None)

    def forget_worker(self, worker: Hashable) -> None:
        """A worker left the fleet: its failure count goes (the shards still avoid it; it is not ready any more)."""
        self.worker_failures.pop(worker, None)


@dataclass
class ShardDeadline:
    """How long a shard may run.

    `timeout_s` is `--shard-timeout-s`: > 0 = a hard deadline (its worker is stopped then, whatever it reports),
    0 = none. None = auto: `SHARD_TIMEOUT_FACTOR` × the shard's expected time, at least `MIN_SHARD_TIMEOUT_S`;
    expected from the seconds per row this run's finished shards took, or before any has finished, from the
    worker's measured seconds per forward × the forwards the shard needs at most (its rows in batches of
    `max_num_seqs`, each `max_tokens` + 1 forwards); with neither, no deadline yet. An auto deadline stops no worker:
    the driver gives a worker past one no new shard until it returns it.
    """

    timeout_s: float | None = None
    max_num_seqs: int = 1
    max_tokens: int = 0  # 0: scoring (one forward a batch)
    measured_rows: int = 0
    measured_seconds: float = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        """A shard of `num_rows` rows finished `seconds` after it started."""
        self.measured_rows += num_rows
        self.measured_seconds += seconds

    def expected_s(self, num_rows: int, seconds_per_forward: float | None) -> float | None:
        """What a shard of `num_rows` rows should take (auto), or None when nothing is known yet."""
        if self.measured_rows:
            return num_rows * self.measured_seconds / self.measured_rows
        if seconds_per_forward:
            forwards = math.ceil(num_rows / self.max_num_seqs) * (self.max_tokens + 1)
            return forwards * seconds_per_forward
        return None

    def timeout_for(self, num_rows: int, seconds_per_forward: float | None = None) -> float | None:
        """Seconds a shard of `num_rows` rows may run; None: no deadline."""
        if self.timeout_s is not None:
            return self.timeout_s or None
        expected = self.expected_s(num_rows, seconds_per_forward)
        return None if expected is None else max(MIN_SHARD_TIMEOUT_S, SHARD_TIMEOUT_FACTOR * expected)

    def describe(self, num_rows: int, seconds_per_forward: float | None = None) -> str:
        """Where the timeout of a shard of `num_rows` rows comes from, for messages."""
        if self.timeout_s is not None:
            return "--shard-timeout-s"
        what = "this run's shards took" if self.measured_rows else "its worker's forwards take"
        expected = self.expected_s(num_rows, seconds_per_forward) or 0.0
        return (
            f"auto: {SHARD_TIMEOUT_FACTOR:g} × the {expected:.0f} s {what} for as many rows, at least "
            f"{MIN_SHARD_TIMEOUT_S:g} s; --shard-timeout-s sets it"
        )

    def deadline(self, num_rows: int, started: float, seconds_per_forward: float | None = None) -> float | None:
        """The clock time (same clock as `started`) by which a shard started at `started` should be done."""
        timeout = self.timeout_for(num_rows, seconds_per_forward)
        return None if timeout is None else started + timeout
