"""Which workers the driver stops, holds back or asks for progress: its hang rules over plain values (no Ray).

Each worker counts the forwards its engine finishes (`workers/heartbeat.py`); the driver polls that count every
PROGRESS_INTERVAL_S while the worker holds shards. A worker whose count has not moved for its stall window is hung
— however large its shards, however long its rows: a worker that is slow but working keeps counting. The window
comes from what the worker measured itself: until its first forward, FIRST_FORWARD_TIMEOUT_S (that forward may page
the weights in, compile kernels and prefill up to --max-num-batched-tokens tokens); then STALL_FACTOR × its longest
forward so far, at least MIN_STALL_TIMEOUT_S. A frozen process answers no poll: no report, no movement, hung alike.

With `--shard-timeout-s` the user's deadline rules instead: a worker holding shards past it is stopped. Either way a
hung worker is stopped once, and each shard it held goes back to the queue once: the shards past the fixed deadline,
or the one it held longest (auto: the hang cannot be blamed on one shard; one retry per stop bounds a shard that
hangs every worker), take a retry; the others do not. In auto mode a shard past its expected time (`ShardDeadline`)
stops nothing: its worker only gets no new shard until it returns it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from pipeline.retry import ShardDeadline
from pipeline.sharding import Shard

FIRST_FORWARD_TIMEOUT_S = 1800.0
MIN_STALL_TIMEOUT_S = 300.0
STALL_FACTOR = 10.0
PROGRESS_INTERVAL_S = 5.0  # how often the driver asks a busy worker for its count


@dataclass
class _Watch:
    """One worker: since when its count has not moved (or since it got work), and its last report."""

    since: float
    busy: bool = False
    num_beats: int | None = None  # None: no report yet
    longest_s: float = 0.0
    mean_s: float = 0.0


class Heartbeats:
    """Workers' progress reports in; which busy workers are hung out. Workers are any hashable handles."""

    def __init__(self) -> None:
        self._workers: dict[Hashable, _Watch] = {}

    def busy(self, worker: Hashable, holding: bool, now: float) -> None:
        """Whether `worker` holds shards now; its clock starts when it gets work after holding none."""
        watch = self._workers.setdefault(worker, _Watch(now))
        if holding and not watch.busy:
            watch.since = now
        watch.busy = holding

    def report(self, worker: Hashable, report: dict[str, Any], now: float) -> None:
        """A heartbeat report (`Heartbeat.report()`) received at `now`."""
        watch = self._workers.get(worker)
        if watch is None:
            return
        if report["num_beats"] != watch.num_beats:
            watch.since = now
        watch.num_beats, watch.longest_s, watch.mean_s = report["num_beats"], report["longest_s"], report["mean_s"]

    def forget(self, worker: Hashable) -> None:
        """A worker left the fleet."""
        self._workers.pop(worker, None)

    def window(self, worker: Hashable) -> float:
        """Seconds `worker` may go without progress before it counts as hung."""
        watch = self._workers.get(worker)
        if watch is None or not watch.num_beats:
            return FIRST_FORWARD_TIMEOUT_S
        return max(MIN_STALL_TIMEOUT_S, STALL_FACTOR * watch.longest_s)

    def deadline(self, worker: Hashable) -> float | None:
        """When a busy `worker` counts as hung unless its count moves first (None: it holds no shard)."""
        watch = self._workers.get(worker)
        return watch.since + self.window(worker) if watch is not None and watch.busy else None

    def hung(self, now: float) -> list[Hashable]:
        """The busy workers whose count has not moved within their window."""
        deadlines = {worker: self.deadline(worker) for worker in self._workers}
        return [worker for worker, deadline in deadlines.items() if deadline is not None and deadline < now]

    def seconds_per_forward(self, worker: Hashable) -> float | None:
        """The mean forward the worker measured (None: none yet)."""
        watch = self._workers.get(worker)
        return watch.mean_s if watch is not None and watch.num_beats else None

    def describe(self, worker: Hashable, now: float) -> str:
        """Why `worker` counts as hung, for messages."""
        watch = self._workers[worker]
        if not watch.num_beats:
            rule = f"auto: {FIRST_FORWARD_TIMEOUT_S:g} s until its first forward"
        else:
            rule = (
                f"auto: {STALL_FACTOR:g} × its longest forward, {watch.longest_s:.1f} s, at least "
                f"{MIN_STALL_TIMEOUT_S:g} s"
            )
        return f"its worker made no progress for {now - watch.since:.0f} s ({rule}; --shard-timeout-s sets a fixed deadline)"


@dataclass(frozen=True)
class Stop:
    """Stop `worker`; requeue what it holds, the shards in `charged` as a retry (`reason` says why)."""

    worker: Hashable
    charged: frozenset[int]
    reason: str


class Watch:
    """The driver's hang rules. `held` maps each ready worker to the (shard, time handed out) it holds."""

    def __init__(self, timeout_s: float | None, max_num_seqs: int = 1, max_tokens: int = 0):
        self.deadlines = ShardDeadline(timeout_s, max_num_seqs, max_tokens)
        self.heartbeats = Heartbeats() if timeout_s is None else None  # auto: progress decides
        self.next_poll: dict[Hashable, float] = {}
        self.held_back: set[Hashable] = set()  # past a shard's expected time, still making progress
        self._said: set[int] = set()

    def check(self, held: dict[Hashable, list[tuple[Shard, float]]], now: float) -> tuple[list[Stop], list[str]]:
        """The workers to stop now and the lines to say; updates `held_back`."""
        if self.heartbeats is None:
            return self._past_fixed_deadline(held, now), []
        for worker, shards in held.items():
            self.heartbeats.busy(worker, bool(shards), now)
        stops = []
        for worker in [w for w in self.heartbeats.hung(now) if held.get(w)]:
            oldest = min(held[worker], key=lambda item: item[1])[0]
            reason = f"{self.heartbeats.describe(worker, now)}; it was stopped"
            stops.append(Stop(worker, frozenset({oldest.index}), reason))
        return stops, self._hold_back(held, now)

    def _past_fixed_deadline(self, held: dict[Hashable, list[tuple[Shard, float]]], now: float) -> list[Stop]:
        reason = f"no result within {self.deadlines.timeout_s:g} s (--shard-timeout-s); its worker was stopped"
        stops = []
        for worker, shards in held.items():
            deadlines = [(shard, self.deadlines.deadline(shard.num_rows, started)) for shard, started in shards]
            overdue = frozenset(shard.index for shard, deadline in deadlines if deadline is not None and now > deadline)
            if overdue:
                stops.append(Stop(worker, overdue, reason))
        return stops

    def _hold_back(self, held: dict[Hashable, list[tuple[Shard, float]]], now: float) -> list[str]:
        self.held_back.clear()
        lines = []
        for worker, shards in held.items():
            per_forward = self.heartbeats.seconds_per_forward(worker)
            for shard, started in shards:
                deadline = self.deadlines.deadline(shard.num_rows, started, per_forward)
                if deadline is None or now <= deadline:
                    continue
                self.held_back.add(worker)
                if shard.index not in self._said:
                    self._said.add(shard.index)
                    lines.append(
                        f"shard {shard.index} has run {now - started:.0f} s, past its expected time "
                        f"({self.deadlines.describe(shard.num_rows, per_forward)}); its worker still makes "
                        "progress: it gets no new shard until this one is back"
                    )
        return lines

    def to_poll(self, held: dict[Hashable, list[tuple[Shard, float]]], polling: set[Hashable], now: float) -> list:
        """The busy workers to ask for progress now (not those with a question outstanding); auto mode only."""
        if self.heartbeats is None:
            return []
        due = [w for w, shards in held.items() if shards and w not in polling and now >= self.next_poll.get(w, 0.0)]
        for worker in due:
            self.next_poll[worker] = now + PROGRESS_INTERVAL_S
        return due

    def report(self, worker: Hashable, report: dict[str, Any], now: float) -> None:
        """A worker's heartbeat report."""
        if self.heartbeats is not None:
            self.heartbeats.report(worker, report, now)

    def forget(self, worker: Hashable) -> None:
        """A worker left the fleet."""
        self.next_poll.pop(worker, None)
        if self.heartbeats is not None:
            self.heartbeats.forget(worker)

    def next_check(self, held: dict[Hashable, list[tuple[Shard, float]]]) -> float | None:
        """The soonest time something here may change: a deadline, a stall window's end, a poll."""
        if self.heartbeats is None:
            times = [
                self.deadlines.deadline(shard.num_rows, started)
                for shards in held.values()
                for shard, started in shards
            ]
        else:
            busy = [worker for worker, shards in held.items() if shards]
            times = [self.heartbeats.deadline(w) for w in busy] + [self.next_poll.get(w, 0.0) for w in busy]
        return min((t for t in times if t is not None), default=None)
