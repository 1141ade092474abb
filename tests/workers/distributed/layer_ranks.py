"""A set of tensor-parallel ranks for layer tests: rank 0 is the pytest process, ranks 1 … T-1 are spawned once and
run the module-level case functions rank 0 hands them (`Ranks.run`), so every rank runs the same code and the
collectives inside it meet. A case returns `{what: max |full − split|}`; `assert_close` checks every rank's.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

from workers.model.distributed.group import make_group
from workers.model.distributed.layout import TensorParallel


def follow(store: str, rank: int, size: int, conn: Connection) -> None:
    """A spawned rank: join the group, then run each `(function, args)` received and send back its result (or the
    error it raised) until None arrives."""
    group = make_group(store, rank, size, timeout_s=60)
    tp = TensorParallel(rank, size, group=group)
    while (message := conn.recv()) is not None:
        function, args = message
        try:
            with torch.no_grad():
                conn.send(function(tp, *args))
        except Exception as error:  # noqa: BLE001 - reported to rank 0, which fails the test with it
            conn.send(RuntimeError(f"rank {rank}: {error!r}"))
    group.close()


class Ranks:
    """Rank 0 (this process) and `size - 1` spawned ranks that run the same case function; returns every rank's
    result."""

    def __init__(self, size: int) -> None:
        context = mp.get_context("spawn")
        store = os.path.join(tempfile.mkdtemp(), "store")
        self.conns, self.processes = [], []
        for rank in range(1, size):
            conn, child = context.Pipe()
            process = context.Process(target=follow, args=(store, rank, size, child), daemon=True)
            process.start()
            self.conns.append(conn)
            self.processes.append(process)
        self.group = make_group(store, 0, size, timeout_s=60)
        self.tp = TensorParallel(0, size, group=self.group)

    def run(self, function: Callable[..., dict[str, float]], *args: object) -> list[dict[str, float]]:
        """`function(tp, *args)` on every rank; their results in rank order."""
        for conn in self.conns:
            conn.send((function, args))
        with torch.no_grad():
            results = [function(self.tp, *args)]
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(120):
                raise TimeoutError(f"rank {rank} did not answer")
            results.append(conn.recv())
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    def close(self) -> None:
        """Stop the spawned ranks and release the group."""
        for conn in self.conns:
            conn.send(None)
        for process in self.processes:
            process.join(timeout=30)
        self.group.close()


def difference(expected: torch.Tensor, got: torch.Tensor) -> float:
    """Max |expected − got| (inf when the shapes differ; 0 for empty tensors)."""
    if expected.shape != got.shape:
        return float("inf")
    return (expected - got).abs().max().item() if expected.numel() else 0.0


def assert_close(results: list[dict[str, float]], tolerance: float) -> None:
    """Every rank's largest difference is within `tolerance` (the message names the rank and the quantity)."""
    for rank, errors in enumerate(results):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= tolerance, f"rank {rank}: {worst} differs by {errors[worst]:.2e} ({errors})"
