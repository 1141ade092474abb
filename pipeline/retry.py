"""What the driver does about failing shards and workers: pure decisions over plain values, tested without Ray.

`RetryPolicy` counts each shard's failures (ending the job past `--max-shard-retries`), remembers which workers a
shard failed on so that its retry goes elsewhere, and says when a worker has failed often enough to be replaced (a
worker with a broken CUDA context fails every shard it gets). `ShardDeadline` says how long a shard may take before
its worker counts as hung: `--shard-timeout-s`, or by default a generous multiple of the time this run's finished
shards took per row. Workers are any hashable handles; nothing here assumes a worker holds one shard at a time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

MAX_WORKER_FAILURES = 2  # shards a worker may fail before it is replaced
FIRST_SHARD_TIMEOUT_S = 3600.0  # auto deadline while no shard has finished to measure throughput
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

    def shard_failed(self, shard: int, worker: Hashable | None) -> Failure:
        """Record that `shard` failed on `worker` (None: the worker is gone and counts for nothing)."""
        self.attempts[shard] += 1
        replace = False
        if worker is not None:
            self.failed_on[shard].add(worker)
            self.worker_failures[worker] += 1
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
    """How long a shard may run before its worker counts as hung.

    `timeout_s` is `--shard-timeout-s`: None = auto, 0 = never, > 0 = that many seconds for every shard. Auto is
    `SHARD_TIMEOUT_FACTOR` × the shard's rows × the seconds per row this run's finished shards took, at least
    `MIN_SHARD_TIMEOUT_S`; `FIRST_SHARD_TIMEOUT_S` until a shard has finished.
    """

    timeout_s: float | None = None
    measured_rows: int = 0
    measured_seconds: float = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        """A shard of `num_rows` rows finished `seconds` after it started."""
        self.measured_rows += num_rows
        self.measured_seconds += seconds

    def timeout_for(self, num_rows: int) -> float | None:
        """Seconds a shard of `num_rows` rows may run; None: no deadline."""
        if self.timeout_s is not None:
            return self.timeout_s or None
        if not self.measured_rows:
            return FIRST_SHARD_TIMEOUT_S
        expected = num_rows * self.measured_seconds / self.measured_rows
        return max(MIN_SHARD_TIMEOUT_S, SHARD_TIMEOUT_FACTOR * expected)

    def describe(self, num_rows: int) -> str:
        """Where the timeout of a shard of `num_rows` rows comes from, for messages."""
        if self.timeout_s is not None:
            return "--shard-timeout-s"
        if not self.measured_rows:
            return "auto: no shard has finished yet to measure throughput; --shard-timeout-s sets it"
        expected = num_rows * self.measured_seconds / self.measured_rows
        return (f"auto: {SHARD_TIMEOUT_FACTOR:g} × the {expected:.0f} s this run's shards took for as many rows, "
                f"at least {MIN_SHARD_TIMEOUT_S:g} s; --shard-timeout-s sets it")  # fmt: skip

    def deadline(self, num_rows: int, started: float) -> float | None:
        """The clock time (same clock as `started`) by which a shard started at `started` must be done."""
        timeout = self.timeout_for(num_rows)
        return None if timeout is None else started + timeout
