"""The vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous block of vocabulary rows.

Every rank holds `ceil(V / T)` rows, `[r·V_l, +V_l)`; the last rank's rows past V are zeros (`vocab_rows`). The
embedding looks up the ids inside its block, zeroes the others and all-reduces: exactly one rank contributes each
token's row, so the sum is that row bit for bit (x + 0 = x). The LM head computes the logits of its rows and
all-gathers them along the vocabulary, then drops the padding, so every rank gets the full float32 logits (the
followers run the same sampling-free code as the leader, and the scorer needs no branch). At one rank both are the
plain `nn.Embedding` / `nn.Linear` computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.distributed.layout import SINGLE_TP, TensorParallel, vocab_rows, vocab_shard_size
from workers.model.distributed.slices import Cut, ShardRule


def vocab_rule(vocab_size: int, tp: TensorParallel) -> ShardRule:
    """The rows `[r·V_l, +V_l)` of an embedding or LM head weight `[V, d]`, zero-padded on the last rank."""
    start, present = vocab_rows(vocab_size, tp)
    return ShardRule((Cut(0, ((start, present),)),), pad_rows=vocab_shard_size(vocab_size, tp) - present)


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings whose rows are split over the ranks (`weight` [V_l, d]); `forward` returns full rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE_TP):
        """`vocab_size`: the whole vocabulary V (this rank holds `vocab_shard_size(V, tp)` rows of it)."""
        super().__init__(vocab_shard_size(vocab_size, tp), hidden_size)
        self.vocab_size = vocab_size
        self.tp = tp
        self.first_row = vocab_rows(vocab_size, tp)[0]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [...] (global ids) → embeddings [..., d], the same on every rank."""
        if not self.tp.parallel:
            return super().forward(token_ids)
        local_ids = token_ids - self.first_row
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings)
        rows = F.embedding(local_ids.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.group.all_reduce_(rows.masked_fill(outside[..., None], 0.0))

    def shard_rules(self) -> dict[str, ShardRule]:
        """This rank's vocabulary rows of the full table."""
        return {"weight": vocab_rule(self.vocab_size, self.tp)}


def gather_logits(local_logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Every rank's logits of its vocabulary rows [..., V_l] → the full logits [..., V] (padding dropped); the
    tensor itself at one rank."""
    if not tp.parallel:
        return local_logits
    return tp.group.all_gather(local_logits, dim=-1)[..., :vocab_size].contiguous()
