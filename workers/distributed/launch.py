"""Starting and stopping a worker's rank processes (rank 0 is the caller's own process).

`RankGroup.start` makes a fresh temporary directory for the group's FileStore (no port to race for), one pipe per
follower, spawns ranks 1 … T-1 (`torch.multiprocessing`'s spawn: a fresh interpreter, no forked CUDA or threads)
and joins the group as rank 0. Followers die with the leader: `PR_SET_PDEATHSIG`, and the pipe's EOF as the second
guard. `close()` (also at interpreter exit) asks them to stop, waits briefly and kills what is left.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

from workers.distributed.channel import READY, LeaderChannel
from workers.distributed.follower import LoadSpec, follower_main
from workers.distributed.lockstep import Lockstep
from workers.model.distributed.group import RankFailure, make_group

JOIN_TIMEOUT_S = 10.0


class RankGroup:
    """The follower processes of one tensor-parallel runner, its control channel and rank 0's collectives."""

    def __init__(self, spec: LoadSpec, processes: list[Any], channel: LeaderChannel, group: Any, store_dir: str):
        self.spec, self.processes, self.channel, self.group = spec, processes, channel, group
        self.store_dir = store_dir
        self.size = spec.config.parallel.tensor_parallel_size
        self.lockstep = Lockstep(0, self.size, group, leader=channel)
        self._closing = False
        atexit.register(self.close)

    @classmethod
    def start(cls, spec: LoadSpec, runner_class: Any) -> RankGroup:
        """Spawn ranks 1 … T-1 (each loads its shard through `runner_class._load_rank`) and join their group as
        rank 0; blocks until every rank has joined (`RankFailure` after `rank_timeout_s`)."""
        parallel = spec.config.parallel
        store_dir = tempfile.mkdtemp(prefix="hybridgen-ranks-")
        store_path = os.path.join(store_dir, "store")
        context = mp.get_context("spawn")
        processes, connections = [], []
        for rank in range(1, parallel.tensor_parallel_size):
            mine, theirs = context.Pipe()
            args = (rank, spec, store_path, theirs, runner_class)
            process = context.Process(target=follower_main, args=args, name=f"rank-{rank}", daemon=True)
            process.start()
            theirs.close()  # the follower's end lives in the follower alone: its death closes the pipe
            processes.append(process)
            connections.append(mine)
        channel = LeaderChannel(connections, processes)
        try:
            _wait_ready(connections, parallel.rank_timeout_s)
            group = make_group(store_path, 0, parallel.tensor_parallel_size, spec.device, parallel.rank_timeout_s)
        except BaseException as error:
            _kill(processes)
            channel.close()
            shutil.rmtree(store_dir, ignore_errors=True)
            raise RankFailure(f"the rank group did not form: {error}") from error
        return cls(spec, processes, channel, group, store_dir)

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(why)` from a watchdog thread when a follower exits before `close()`."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}

        def run() -> None:
            ready = wait(list(sentinels))
            if self._closing:
                return
            rank = sentinels[ready[0]]
            on_failure(f"rank {rank} of {self.size} exited (code {self.processes[rank - 1].exitcode})")

        threading.Thread(target=run, name="rank-watchdog", daemon=True).start()

    def kill_rank(self, rank: int) -> None:
        """Fault injection: follower `rank` SIGKILLs itself when it reads this message (in program order)."""
        if not 1 <= rank < self.size:
            raise ValueError(f"rank={rank} is invalid: must be a follower rank, 1 … {self.size - 1}")
        self.channel.send("die", rank)

    def close(self) -> None:
        """Stop the followers (a `close` message, then SIGKILL for any still running after a grace period), close
        rank 0's collectives and remove the store. Idempotent."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        try:
            self.channel.send("close")
        except RankFailure:
            pass
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
        _kill(self.processes)
        self.channel.close()
        self.group.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def _wait_ready(connections: list[Any], timeout_s: float) -> None:
    """Wait for every follower's `ready` (sent once it has imported and set up, before it joins the group): a
    follower that fails to start fails the start at once instead of after the group's timeout."""
    for rank, connection in enumerate(connections, start=1):
        if not connection.poll(timeout_s):
            raise RankFailure(f"rank {rank} did not start within {timeout_s} s")
        try:
            kind, text = connection.recv()
        except EOFError:
            raise RankFailure(f"rank {rank} exited while starting") from None
        if kind != READY:
            raise RankFailure(f"rank {rank} failed to start: {text}")


def _kill(processes: list[Any]) -> None:
    """SIGKILL the processes still running, and reap them."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join(JOIN_TIMEOUT_S)


class RankOwner:
    """What a runner on rank 0 offers about its follower processes (none at one rank: `_rank_group` is None)."""

    _rank_group: RankGroup | None = None  # set by `ModelRunner.from_pretrained` when it started a group

    def watch_ranks(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(why)` from a watchdog thread when a follower rank dies (the Ray actor kills itself
        then, so the driver replaces the worker). One rank: nothing to watch."""
        if self._rank_group is not None:
            self._rank_group.watch(on_failure)

    def kill_rank(self, rank: int) -> None:
        """Fault injection (tests, the actor's `kill_rank_during_shard`): follower `rank` SIGKILLs itself when it
        reaches this point of the request stream; the leader then raises `RankFailure`."""
        if self._rank_group is None:
            raise ValueError(f"rank={rank} is invalid: this runner has no follower ranks (tensor_parallel_size=1)")
        self._rank_group.kill_rank(rank)

    def close(self) -> None:
        """Stop the follower ranks (nothing at one rank); the runner cannot step after this. Idempotent."""
        if self._rank_group is not None:
            self._rank_group.close()

    def __enter__(self) -> RankOwner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
