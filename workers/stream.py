"""Shards streamed through one runner: rows of the next shard enter free slots while the current shard's last rows
finish, so a worker never drains its batch between shards.

The driver keeps more than one shard in flight per worker (a threaded Ray actor: each `submit` comes from its own
call). One engine thread owns the runner: it takes new shards' rows between steps, and resolves a shard's future as
soon as all of its rows are done. A failure inside a step fails every shard in flight (the driver requeues them);
a worker that dies loses only the shards it had not returned.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from workers.requests import GenerationResult
from workers.runner import ModelRunner
from workers.sampling import SamplingParams

# Shards a worker holds at once (the driver keeps it fed to this depth). Two are not enough: a shard is returned
# only when its slowest row is done, and with long-tailed output lengths the batch runs short of rows while one
# straggler holds a shard back (192 rows, 64-row shards, max_num_seqs 32: 1.16× the steps of one call with two in
# flight, the same steps as one call with three).
SHARDS_PER_WORKER = 3
T = TypeVar("T")


@dataclass
class _Shard:
    """A submitted shard: its rows' results as they finish, and the future its caller waits on."""

    results: list[GenerationResult | None]
    future: Future = field(default_factory=Future)
    num_left: int = 0


class ShardStream:
    """Feeds shards' prompts into one `ModelRunner` from a single engine thread (see the module docstring).

    Every torch call of a worker belongs on that thread, model loading included (`call`): OpenMP keeps a team of
    threads per calling thread, and two teams on a CPU's cores (the loading thread's and the engine's) slow the
    native decode steps about twofold (measured on 2 cores: 1.0 s against 0.5 s for one batch)."""

    def __init__(self, runner: ModelRunner | None = None):
        """`runner`: set here or later (`stream.runner = …`, typically the result of a loading `call`); from then on
        the stream owns it: nothing else may call its `generate`, `add_request` or `step`."""
        self.runner = runner
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._shards: dict[Hashable, _Shard] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between steps (loading the model, scoring a shard); its future."""
        future: Future[T] = Future()
        self._put(("call", fn, future))
        return future

    def submit(
        self, shard_id: Hashable, prompts: list[list[int]], params: list[SamplingParams]
    ) -> Future[list[GenerationResult]]:
        """Queue a shard's prompts; the future resolves to their results (in order) when all are done."""
        shard = _Shard([None] * len(prompts), num_left=len(prompts))
        if not prompts:
            shard.future.set_result([])
            return shard.future
        self._put(("shard", shard_id, prompts, params, shard))
        return shard.future

    def _put(self, item: tuple) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="hybridgen-engine", daemon=True)
                self._thread.start()
            self._inbox.put(item)

    def _loop(self) -> None:
        """Engine thread: take new work (waiting only when there is nothing to run), step, hand back results."""
        if self.runner is not None:
            self.runner.prepare_thread()
        while True:
            busy = self.runner is not None and self.runner.has_unfinished_requests()
            self._take_new(block=not busy)
            if self.runner is None or not self.runner.has_unfinished_requests():
                continue
            try:
                finished = self.runner.step()
            except BaseException as error:  # every shard in flight fails; the driver requeues them
                self._fail_all(error)
                continue
            for (shard_id, row), result in finished:
                shard = self._shards[shard_id]
                shard.results[row] = result
                shard.num_left -= 1
                if shard.num_left == 0:
                    del self._shards[shard_id]
                    shard.future.set_result(shard.results)

    def _take_new(self, block: bool) -> None:
        """Run the calls and add the rows of the shards submitted since the last step (waiting for one when
        `block`)."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item[0] == "call":
                _, fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as error:
                    future.set_exception(error)
                continue
            _, shard_id, prompts, params, shard = item
            self._shards[shard_id] = shard
            for row, (prompt, p) in enumerate(zip(prompts, params)):
                self.runner.add_request((shard_id, row), prompt, p)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every shard in flight and forget its requests (the runner's engine is rebuilt for the next)."""
        for shard in self._shards.values():
            shard.future.set_exception(error)
        self._shards.clear()
        self.runner.reset()
