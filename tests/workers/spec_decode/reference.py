"""The target's next-token logits from one plain forward: the reference the sampled speculative tests compare with
(independent of the runner's step code)."""

from __future__ import annotations

import torch

from workers import ModelRunner
from workers.model import ForwardBatch, StatePool


def last_position_logits(runner: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
    """Logits [len(sequences), v] after each sequence, from fresh states (right-padded, one forward)."""
    lengths = [len(s) for s in sequences]
    ids = torch.tensor([s + [0] * (max(lengths) - len(s)) for s in sequences])
    pool = StatePool(runner.config, len(sequences), max(lengths), torch.device("cpu"), torch.float32)
    batch = ForwardBatch(
        torch.arange(len(sequences)), torch.zeros(len(sequences), dtype=torch.long), torch.tensor(lengths)
    )
    with torch.no_grad():
        hidden = runner.model(ids, batch, pool.zeros(len(sequences)), pool.kv_caches()).hidden
    return runner.model.logits(hidden[torch.arange(len(sequences)), torch.tensor(lengths) - 1])
