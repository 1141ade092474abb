"""The rank group's collectives over gloo: identical bits on every rank, batch-independent sums, dead peers."""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

from workers.model.distributed.group import SINGLE, RankFailure, make_group


def _collectives(rank: int, store: str, size: int, queue) -> None:
    group = make_group(store, rank, size)
    torch.manual_seed(rank)
    batch = torch.randn(5, 33)
    summed = group.all_reduce_(batch.clone())
    alone = group.all_reduce_(batch[2:3].clone())  # one row alone: the same bits as inside the batch
    gathered = group.all_gather(torch.full((2, 3), float(rank)), dim=-1)
    low = group.all_reduce_min([10 + rank, 20 - rank])
    # Plain lists: a tensor on the queue shares memory through a descriptor this process may close before the
    # parent reads it.
    queue.put((rank, summed.tolist(), alone.tolist(), gathered.tolist(), low, group.stats.calls))
    group.barrier()
    group.close()


def _dies(rank: int, store: str, size: int, queue) -> None:
    group = make_group(store, rank, size, timeout_s=5.0)
    if rank == 1:
        os._exit(1)
    start = time.perf_counter()
    try:
        group.all_reduce_(torch.ones(4))
        queue.put(("no error", 0.0))
    except RankFailure as error:
        queue.put((str(error), time.perf_counter() - start))


def run_ranks(target, size: int) -> list:
    """Run `target(rank, store, size, queue)` in `size` spawned processes; their queue items."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    processes = [context.Process(target=target, args=(rank, store, size, queue)) for rank in range(size)]
    for process in processes:
        process.start()
    items = [queue.get(timeout=60) for _ in range(size if target is _collectives else 1)]
    for process in processes:
        process.join(timeout=30)
    return items


def test_ordered_all_reduce_all_gather_and_min() -> None:
    items = sorted(run_ranks(_collectives, 3), key=lambda item: item[0])
    expected = sum(torch.manual_seed(rank) and torch.randn(5, 33) for rank in range(3))
    for _rank, summed, alone, gathered, low, calls in items:
        assert summed == items[0][1], "every rank holds the same bits"
        assert torch.allclose(torch.tensor(summed), expected, atol=1e-6)
        assert alone[0] == summed[2], "a row's sum does not depend on its batch"
        assert gathered == [[0.0] * 3 + [1.0] * 3 + [2.0] * 3] * 2
        assert low == [10, 18] and calls == 4


def test_a_dead_peer_raises_rank_failure() -> None:
    [(message, seconds)] = run_ranks(_dies, 2)
    assert "failed" in message and "peer rank" in message
    assert seconds < 10


def test_single_rank_is_the_identity() -> None:
    tensor = torch.randn(3)
    assert SINGLE.all_reduce_(tensor) is tensor and SINGLE.all_gather(tensor) is tensor
    assert SINGLE.all_reduce_min([3, 1]) == [3, 1]
