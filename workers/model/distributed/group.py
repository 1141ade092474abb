"""The collectives a tensor-parallel rank group runs, as an object each layer is handed (no global default group).

A model split over T ranks needs three collectives: an all-reduce of a row-parallel output (a partial sum), an
all-gather of the vocabulary-parallel logits, and a MIN over small integers at start-up (so every rank sizes its
pools alike). `SINGLE` is the one-rank group: every collective returns its input, so the single-GPU path runs the
same code with no branch.

On CPU the group is gloo, built directly as a `ProcessGroupGloo` over a `FileStore` (several groups can live in one
process, and a store in a temporary directory cannot race for a port). Its all-reduce is *ordered*: an all-gather,
then a sum in rank order, so every rank gets the same bits and a row's sum does not depend on the batch it rode in
(gloo's own ring all-reduce adds in an order that depends on the tensor's size). On CUDA the group is NCCL, with its
native all-reduce. Every group counts its calls, bytes and seconds for the tensor-parallel benchmark.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

DEFAULT_TIMEOUT_S = 120.0


class RankFailure(RuntimeError):
    """A collective could not finish: a peer rank died or stopped answering (the group is lost)."""


@dataclass
class CollectiveStats:
    """What a group's collectives cost so far: calls, payload bytes (this rank's tensor) and wall seconds."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [calls, bytes, seconds]

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count one collective of `kind` that moved `nbytes` in `seconds`."""
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds
        entry = self.by_kind.setdefault(kind, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += seconds


class Collectives(Protocol):
    """The collectives of one rank group, as a layer calls them."""

    rank: int
    size: int
    stats: CollectiveStats

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place, identical bits on every rank; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors (same shape) concatenated along `dim` in rank order."""
        ...

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Elementwise minimum of small integer lists over the ranks."""
        ...

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        ...

    def close(self) -> None:
        """Release the group's connections."""
        ...


class SingleRank:
    """The one-rank group: every collective is the identity (the single-device path, no branch in the layers)."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.stats = CollectiveStats()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor itself (a sum over one rank)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The tensor itself (one rank's part is the whole)."""
        return tensor

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """The values themselves."""
        return list(values)

    def barrier(self) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""


SINGLE = SingleRank()


class ProcessGroupCollectives:
    """Collectives over a torch `ProcessGroup` (gloo on CPU, NCCL on CUDA); gloo's all-reduce is the ordered one."""

    def __init__(self, group: torch.distributed.ProcessGroup, rank: int, size: int, ordered: bool) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.ordered = ordered
        self.stats = CollectiveStats()

    def _wait(self, kind: str, work: torch.distributed.Work, nbytes: int, start: float) -> None:
        try:
            work.wait()
        except RuntimeError as error:  # gloo: connection reset / timeout when a peer is gone
            raise RankFailure(f"rank {self.rank}: {kind} failed ({error}); a peer rank died or hung") from error
        self.stats.add(kind, nbytes, time.perf_counter() - start)

    def _gather(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        start = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        work = self.group.allgather([parts], [tensor])
        self._wait(kind, work, tensor.numel() * tensor.element_size(), start)
        return parts

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks in place. Ordered (gloo): gather every rank's part, add them in rank order."""
        if not self.ordered:
            start = time.perf_counter()
            work = self.group.allreduce([tensor])
            self._wait("all_reduce", work, tensor.numel() * tensor.element_size(), start)
            return tensor
        parts = self._gather(tensor, "all_reduce")
        total = parts[0]
        for part in parts[1:]:
            total = total.add_(part)
        return tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, rank 0's first."""
        return torch.cat(self._gather(tensor, "all_gather"), dim=dim)

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Elementwise minimum over the ranks."""
        parts = self._gather(torch.tensor(values, dtype=torch.int64), "all_reduce_min")
        return torch.stack(parts).min(dim=0).values.tolist()

    def barrier(self) -> None:
        """Wait for every rank (an all-reduce of one integer, which gloo and NCCL both order)."""
        self.all_reduce_min([0])

    def close(self) -> None:
        """Shut the process group down (its peers see a closed connection)."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass


def make_group(
    store_path: str, rank: int, size: int, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
) -> ProcessGroupCollectives:
    """Join the group of `size` ranks that rendezvous at the file `store_path`: gloo on CPU, NCCL on CUDA.

    Every rank of one group passes the same `store_path` (a file in a fresh temporary directory) and blocks here
    until all have joined."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the group of {size} ranks")
    store = torch.distributed.FileStore(store_path, size)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.startswith("cuda"):
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = torch.distributed.ProcessGroupNCCL(store, rank, size, options)
        return ProcessGroupCollectives(group, rank, size, ordered=False)
    group = torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
    return ProcessGroupCollectives(group, rank, size, ordered=True)
