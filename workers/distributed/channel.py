"""The ordered control channel from the leader (rank 0) to its followers: tagged, pickled messages over
`multiprocessing` pipes made before the spawn. A pipe may sit idle between shards for as long as the caller likes
(a gloo broadcast would time out), and a follower reads the messages in the order the leader sent them.

Every message is `(tag, value)`; a follower that expects one tag and reads another has left the leader's program
order, and says so (`RankDivergence`). A follower that fails sends its error back up its pipe before it exits, so
the leader raises it on its next send instead of hanging.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from workers.model.distributed.group import RankFailure


class RankDivergence(RankFailure):
    """A follower's program order or scheduler state left the leader's: the group's ranks no longer agree."""


class StepAborted(Exception):
    """The leader failed inside a step: the follower drops the step and waits for the leader's next message."""


ABORT = "abort"  # the leader's step failed part-way (whatever the follower waits for, it drops the step)
ERROR, DIVERGED = "error", "diverged"  # what a failing follower sends back up its pipe
READY = "ready"  # what a follower sends once it has started, before it joins the group


class LeaderChannel:
    """Rank 0's end: one pipe per follower (rank 1 … T-1, in order), and their processes to tell a dead one."""

    def __init__(self, connections: Sequence[Connection], processes: Sequence[BaseProcess] = ()):
        self.connections, self.processes = list(connections), list(processes)
        self.failure: RankFailure | None = None  # the first failure found: every later send raises it again

    def send(self, tag: str, value: Any = None) -> None:
        """Send `(tag, value)` to every follower (pickled once); `RankFailure` when one has failed or died."""
        self.check()
        payload = pickle.dumps((tag, value), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, connection in enumerate(self.connections, start=1):
            try:
                connection.send_bytes(payload)
            except OSError as error:  # EPIPE: the follower's end is closed, so the process is gone
                self.check()
                self.failure = RankFailure(f"rank {rank} is gone ({error}) while sending {tag!r}")
                raise self.failure from error

    def check(self) -> None:
        """Raise what a follower reported (`RankDivergence` or `RankFailure`), or `RankFailure` for one that
        exited; cheap (a poll and a non-blocking wait per follower). The first failure found sticks."""
        if self.failure is None:
            self.failure = self._find_failure()
        if self.failure is not None:
            raise self.failure

    def _find_failure(self) -> RankFailure | None:
        for rank, connection in enumerate(self.connections, start=1):
            process = self.processes[rank - 1] if self.processes else None
            exited = process is not None and process.exitcode is not None
            report = _report(connection)  # read after the exit check: a follower reports before it exits
            if report is not None:
                kind, text = report
                return (RankDivergence if kind == DIVERGED else RankFailure)(f"rank {rank}: {text}")
            if exited:
                return RankFailure(f"rank {rank} exited with code {process.exitcode}")
        return None

    def close(self) -> None:
        """Close the leader's ends (a follower still reading sees EOF and exits)."""
        for connection in self.connections:
            connection.close()


def _report(connection: Connection) -> tuple[str, str] | None:
    """A follower's report waiting in its pipe, if any."""
    try:
        return connection.recv() if connection.poll() else None
    except (EOFError, OSError):
        return None


class FollowerChannel:
    """A follower's end: reads the leader's messages in order and reports its own failure back."""

    def __init__(self, connection: Connection):
        self.connection = connection

    def next(self) -> tuple[str, Any]:
        """The leader's next message; `EOFError` when the leader is gone."""
        return pickle.loads(self.connection.recv_bytes())

    def recv(self, tag: str) -> Any:
        """The value of the next message, which must be `tag` (`RankDivergence` naming both tags when it is not);
        `StepAborted` when the leader failed computing it."""
        got, value = self.next()
        if got == ABORT:
            raise StepAborted(tag)
        if got != tag:
            raise RankDivergence(f"expected message {tag!r}, got {got!r}")
        return value

    def ready(self) -> None:
        """Tell the leader this follower has started (imports done) and joins the group now."""
        self.connection.send((READY, None))

    def report(self, error: BaseException) -> None:
        """Tell the leader why this follower stops (best effort: the leader may be gone already)."""
        kind = DIVERGED if isinstance(error, RankDivergence) else ERROR
        try:
            self.connection.send((kind, f"{type(error).__name__}: {error}"))
        except OSError:
            pass
