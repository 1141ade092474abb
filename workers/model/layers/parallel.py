"""Falcon-H1's parallel mixer: Mamba2 and attention side by side on the same normed input, outputs summed.

One block holds both: a Mamba2 recurrent state and a KV cache. The μP multipliers around the two branches (SSM
in / out, per-projection SSM multipliers, attention in / out, key) are folded into the projection weights at load
(`families/falcon_h1.py`), so the branches are the plain `Mamba2Mixer` and `Attention`.

Tensor parallel: both branches are split (heads) and each returns a partial sum (its output bias on rank 0 only),
so their sum is a partial sum too and the model's one central all-reduce completes it.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.layers.attention import Attention
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.state import ForwardBatch, KVCache, MambaState, ScanInputs


class ParallelMixer(nn.Module):
    """mamba(x) + self_attn(x); parameter names follow the hub checkpoints (`mamba.*`, `self_attn.*`)."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the tensor-parallel group."""
        super().__init__()
        self.mamba = Mamba2Mixer(config, tp=tp)
        # The attention branch takes `tp` for its shard rules (slice S2b); a single rank's needs none.
        self.self_attn = Attention(config, tp=tp)

    def forward(
        self,
        hidden: torch.Tensor,
        state: MambaState | None,
        num_tokens: torch.Tensor,
        in_place: bool,
        batch: ForwardBatch,
        cache: KVCache,
        static_shapes: bool = False,
    ) -> tuple[torch.Tensor, MambaState, ScanInputs | None]:
        """hidden [b, l, d] → (out [b, l, d], Mamba2 state after each row's last valid token, its scan inputs).

        The recurrent mixer contract (`Mamba2Mixer.forward`) plus the attention branch's batch and KV cache;
        `static_shapes`: the attention branch's CUDA-graph form (`Attention.forward_static`)."""
        out, new_state, scan = self.mamba(hidden, state, num_tokens, in_place)
        attend = self.self_attn.forward_static if static_shapes else self.self_attn
        return out + attend(hidden, batch, cache), new_state, scan

    def state_after(
        self, state: MambaState, scan: ScanInputs, num_tokens: torch.Tensor, static_shapes: bool = False
    ) -> MambaState:
        """The Mamba2 branch's state after each row's first `num_tokens` inputs (speculative state shifting; the
        KV cache needs no shift: positions past the kept length are overwritten)."""
        return self.mamba.state_after(state, scan, num_tokens, static_shapes)
