"""A worker's progress as the driver sees it: how many units of work its engine has finished, and the longest one.

A unit is one forward of the model: a generation step (a prefill chunk, a decode or a verification step, with the
tokenizing of the rows it admits) or a scoring forward, each bounded by --max-num-batched-tokens. The driver polls `report()` (a cheap call that
never waits for the engine) and tells a slow worker from a hung one by whether the count moves: a worker that takes
hours over a large shard keeps beating; a frozen one stops (`pipeline/liveness.py`).
"""

from __future__ import annotations

import time
from typing import Any


class Heartbeat:
    """Counts units of work and measures them: `start()` when work begins after a rest, `beat()` after each unit,
    `rest()` when the engine has nothing to do (the wait until the next unit is not work)."""

    def __init__(self) -> None:
        self.num_beats = 0
        self.longest_s = 0.0  # the longest unit (time from the previous beat or start to a beat)
        self.total_s = 0.0  # time in units, over the worker's life
        self._since: float | None = None

    def start(self) -> None:
        """Work begins (no effect while already working)."""
        if self._since is None:
            self._since = time.perf_counter()

    def beat(self) -> None:
        """A unit of work is done."""
        now = time.perf_counter()
        if self._since is not None:
            self.longest_s = max(self.longest_s, now - self._since)
            self.total_s += now - self._since
        self._since = now
        self.num_beats += 1

    def rest(self) -> None:
        """Nothing to do until new work arrives."""
        self._since = None

    def report(self) -> dict[str, Any]:
        """What the driver polls: units done, the longest and the mean unit's seconds."""
        mean = self.total_s / self.num_beats if self.num_beats else 0.0
        return {"num_beats": self.num_beats, "longest_s": self.longest_s, "mean_s": mean}
