"""Shards streamed through one runner: rows of the next shard enter free slots while the current shard's last rows
finish, so a worker never drains its batch between shards.

The driver keeps more than one shard in flight per worker (a threaded Ray actor: each `submit` comes from its own
call). One engine thread owns the runner: between steps it takes new shards, tokenizes their rows as the engine has
room for them (at most ROWS_AHEAD_PER_SEQ × max_num_seqs rows in the engine, so a worker never holds the token ids
of whole shards), and resolves a shard's future as soon as all of its rows are done. A step that raises fails only
the shards whose rows it ran (`StepFailed`); the other shards' rows go on in a fresh engine. A worker that dies
loses only the shards it had not returned. `heartbeat` counts what the engine finishes, for the driver.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from workers.heartbeat import Heartbeat
from workers.requests import GenerationResult
from workers.rows import error_result
from workers.runner import ModelRunner
from workers.sampling import SamplingParams

# Shards a worker holds at once (the driver keeps it fed to this depth). Two are not enough: a shard is returned
# only when its slowest row is done, and with long-tailed output lengths the batch runs short of rows while one
# straggler holds a shard back (192 rows, 64-row shards, max_num_seqs 32: 1.16× the steps of one call with two in
# flight, the same steps as one call with three).
SHARDS_PER_WORKER = 3
ROWS_AHEAD_PER_SEQ = 2  # rows in the engine per slot at most: a full batch running and the next one waiting
T = TypeVar("T")
Request = tuple[list[int] | str, SamplingParams | None]  # a row's prompt and sampling, or why it cannot run and None


class StepFailed(RuntimeError):
    """Raised for every shard whose rows ran in a step that raised; `failure_id` is the same for all of them, so
    the driver counts one failure of the worker, not one per shard."""

    def __init__(self, message: str, failure_id: str):
        super().__init__(message)
        self.failure_id = failure_id

    def __reduce__(self) -> tuple:
        return StepFailed, (str(self), self.failure_id)


@dataclass
class _Shard:
    """A submitted shard: its rows still to tokenize, those in the engine, the results so far, its future."""

    requests: Iterator[Request]
    results: list[GenerationResult | None]  # row-major: num_samples per row
    num_samples: int = 1  # results per row (`SamplingParams.n`)
    future: Future = field(default_factory=Future)
    num_left: int = 0  # results still to come
    num_taken: int = 0  # rows taken from `requests`
    live: dict[int, tuple[list[int], SamplingParams]] = field(default_factory=dict)  # rows in the engine
    live_samples: dict[int, int] = field(default_factory=dict)  # row in the engine → its samples not done yet
    exhausted: bool = False


class ShardStream:
    """Feeds shards' prompts into one `ModelRunner` from a single engine thread (see the module docstring).

    Every torch call of a worker belongs on that thread, model loading included (`call`): OpenMP keeps a team of
    threads per calling thread, and two teams on a CPU's cores (the loading thread's and the engine's) slow the
    native decode steps about twofold (measured on 2 cores: 1.0 s against 0.5 s for one batch)."""

    def __init__(self, runner: ModelRunner | None = None):
        """`runner`: set here or later (`stream.runner = …`, typically the result of a loading `call`); from then on
        the stream owns it: nothing else may call its `generate`, `add_request` or `step`."""
        self.runner = runner
        self.heartbeat = Heartbeat()
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._shards: dict[Hashable, _Shard] = {}  # in submission order: the oldest shard's rows go in first
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between steps (loading the model, scoring a shard); its future."""
        future: Future[T] = Future()
        self._put(("call", fn, future))
        return future

    def submit(
        self, shard_id: Hashable, requests: Iterable[Request], num_rows: int, num_samples: int = 1
    ) -> Future[list[GenerationResult]]:
        """Queue a shard of `num_rows` rows: `requests` yields each row's (prompt token ids, sampling with
        n = `num_samples`), or (why it cannot run, None), and is read lazily on the engine thread. The future
        resolves to `num_samples` results per row, row-major (samples in order), when all are done."""
        size = num_rows * num_samples
        shard = _Shard(iter(requests), [None] * size, num_samples, num_left=size)
        if not num_rows:
            shard.future.set_result([])
            return shard.future
        self._put(("shard", shard_id, shard))
        return shard.future

    def _put(self, item: tuple) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="hybridgen-engine", daemon=True)
                self._thread.start()
            self._inbox.put(item)

    def _loop(self) -> None:
        """Engine thread: take new work (waiting only when there is nothing to run), feed rows, step, hand back."""
        if self.runner is not None:
            self.runner.prepare_thread()
        while True:
            self._take_new(block=not self._has_work())
            if self.runner is None:
                continue
            self._feed()
            if not self.runner.has_unfinished_requests():
                continue
            try:
                finished = self.runner.step()
            except BaseException as error:  # the shards it ran fail (the driver requeues them); the rest go on
                self._step_failed(error)
                continue
            self.heartbeat.beat()
            for (shard_id, row), result in finished:
                self._finish(shard_id, row, result)

    def _has_work(self) -> bool:
        if self.runner is None:
            return False
        return self.runner.has_unfinished_requests() or any(not s.exhausted for s in self._shards.values())

    def _take_new(self, block: bool) -> None:
        """Run the calls and register the shards submitted since the last step (waiting for one when `block`)."""
        if block:
            self.heartbeat.rest()
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            self.heartbeat.start()
            if item[0] == "call":
                _, fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as error:
                    future.set_exception(error)
                continue
            _, shard_id, shard = item
            self._shards[shard_id] = shard

    def _feed(self) -> None:
        """Tokenize the next rows, oldest shard first, while the engine holds fewer than its share of rows."""
        live = sum(n for s in self._shards.values() for n in s.live_samples.values())
        room = ROWS_AHEAD_PER_SEQ * self.runner.max_num_seqs - live  # in sequences: a row takes n of them
        for shard_id, shard in list(self._shards.items()):
            while room > 0 and not shard.exhausted:
                try:
                    prompt, params = next(shard.requests)
                except StopIteration:
                    shard.exhausted = True
                    break
                except BaseException as error:  # a bug in reading the rows: this shard fails, not the thread
                    del self._shards[shard_id]
                    shard.future.set_exception(error)
                    break
                row, shard.num_taken = shard.num_taken, shard.num_taken + 1
                if params is None:
                    for j in range(shard.num_samples):
                        self._finish(shard_id, row, error_result(prompt, j))
                    continue
                shard.live[row], shard.live_samples[row] = (prompt, params), params.n
                self.runner.add_request((shard_id, row), prompt, params)
                room -= params.n

    def _finish(self, shard_id: Hashable, row: int, result: GenerationResult) -> None:
        shard = self._shards.get(shard_id)
        if shard is None:
            return
        shard.live_samples[row] = shard.live_samples.get(row, 1) - 1
        if shard.live_samples[row] <= 0:
            shard.live.pop(row, None)
            shard.live_samples.pop(row)
        where = row * shard.num_samples + result.sample_index
        if shard.results[where] is not None:  # a sample done before a failed step re-ran its row: the first stays
            return
        shard.results[where] = result
        shard.num_left -= 1
        if shard.num_left == 0:
            del self._shards[shard_id]
            shard.future.set_result(shard.results)

    def _step_failed(self, error: BaseException) -> None:
        """Fail the shards whose rows the failed step ran (all of them when it ran none: the failure cannot be told
        apart); put the other shards' rows into the runner's fresh engine."""
        blamed = {request_id[0] for request_id in self.runner.live_request_ids()} or set(self._shards)
        self.runner.reset()
        shards = ", ".join(str(s) for s in sorted(blamed, key=str))
        failure = StepFailed(
            f"{type(error).__name__}: {error} (a step running rows of shards {shards})", uuid.uuid4().hex
        )
        for shard_id in list(self._shards):
            shard = self._shards[shard_id]
            if shard_id in blamed:
                del self._shards[shard_id]
                shard.future.set_exception(failure)
                continue
            for row, (prompt, params) in shard.live.items():  # with all its samples: done ones are kept, not redone
                shard.live_samples[row] = params.n
                self.runner.add_request((shard_id, row), prompt, params)
