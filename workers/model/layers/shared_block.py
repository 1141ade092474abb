"""Zamba2's shared transformer blocks and their uses at the hybrid layers.

A Zamba2 hybrid layer runs, before its Mamba2 block, one *use* of a shared transformer block (`num_blocks` weight
sets, used round-robin): on x2 = rmsnorm([hidden, original embeddings]) (2d wide) it computes

    a = attention(x2)            q, k, v = W·x2 + up(down(x2)) — the use's low-rank adapters, when the model has them
    m = mlp(rmsnorm(a))          gate, up = W·h + up(down(h)); down(gelu(gate) · up) — no residual inside the block
    T = linear(m)                the use's own output projection, d → d

and the Mamba2 block then reads rmsnorm(hidden + T) while its residual stays `hidden` (`HybridModel.forward`).
The shared weights are the same modules in every use (registered under each, like tied weights: the loader fills
each alias, `prepare_linears` replaces a shared Linear once); each use has its own KV cache, adapters and linear.
On the native path (CPU float32) gelu(gate) · up runs through the native kernel a decode plan records
(`steps/shared_block_records.py`), so plan and module compute the same bits.

Tensor parallel (`tp`, built from the rank's local config): q, k, v by heads (an adapter's `down` whole, its `up`
cut like the projection it adds to), o_proj row-parallel, the MLP's [gate | up] rows by rank and its down_proj
row-parallel. A use all-reduces twice inside — the attention's partial before `pre_ff_norm`, and T, the use's
`linear` applied to the MLP's partial (it is linear) — and returns the **whole** T: the model's Zamba2 branch feeds
it to `next_norm(hidden + T)` without the central all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import SHARED_ATTENTION, HybridConfig, SharedBlockConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule
from workers.model.kernels import native
from workers.model.layers.attention import Attention
from workers.model.layers.head_split import column_parallel, head_rows, row_parallel, share
from workers.model.layers.norm import RMSNorm
from workers.model.state import ForwardBatch, KVCache


def gelu_mul(h: torch.Tensor, use_native: bool) -> torch.Tensor:
    """gelu(gate) · up (the erf form) for h [..., 2n] = [gate | up] → [..., n]; through the native kernel when asked,
    so that a decode plan, which records that kernel, computes the same bits."""
    if use_native and native.fits(h):
        return native.gelu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate) * up


class LowRank(nn.Module):
    """A low-rank adapter: up(down(x)), no biases (checkpoint keys `…adapter_list.N.{0,1}.weight`)."""

    def __init__(self, in_features: int, rank: int, out_features: int):
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        return self.up(self.down(x))


class AdaptedLinear(nn.Module):
    """A shared Linear plus, when given, one use's low-rank adapter: base(x) + adapter(x)."""

    def __init__(self, base: nn.Module, adapter: LowRank | None):
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        out = self.base(x)
        return out if self.adapter is None else out + self.adapter(x)


class SharedTransformer(nn.Module):
    """The weights of one shared block (hub: `model.layers.N.shared_transformer.*`)."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        s, a, d = config.shared_block, config.attention, config.hidden_size
        self.input_norm = RMSNorm(2 * d, config.rms_norm_eps)
        self.q_proj = nn.Linear(2 * d, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * d, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * d, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, d, bias=False)
        self.pre_ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * s.intermediate_size, bias=s.bias)
        self.down_proj = nn.Linear(s.intermediate_size, d, bias=s.bias)


class SharedBlockUse(nn.Module):
    """One use of a shared block at a hybrid layer: (hidden, embeddings) → T, the layer's Mamba2 input addend.

    Built with only its output projection by `Block`; `bind` attaches the shared weights and builds the use's
    adapters (`bind_shared_blocks` does it for a whole model).
    """

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the group."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.use_index = -1  # this use's position among the model's uses (its adapters' index); set by `bind`
        self.native = False  # the MLP's gelu(gate) · up through the native kernel (set at load for CPU float32)

    def bind(self, shared: SharedTransformer, use_index: int) -> None:
        """Attach the shared block's weights and this use's adapters: the attention (this use's own module over
        its own KV cache, with the shared projections plus adapters), the norms and the MLP."""
        s: SharedBlockConfig = self.config.shared_block
        a, d = self.config.attention, self.config.hidden_size

        def adapter(in_features: int, out_features: int, present: bool) -> LowRank | None:
            return LowRank(in_features, s.adapter_rank, out_features) if present else None

        self.use_index = use_index
        self.input_norm, self.pre_ff_norm, self.down_proj = shared.input_norm, shared.pre_ff_norm, shared.down_proj
        self.gate_up_proj = AdaptedLinear(shared.gate_up_proj, adapter(d, 2 * s.intermediate_size, s.mlp_adapters))
        attention = Attention(replace(self.config, hidden_size=2 * d), tp=self.tp)
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        attention.q_proj = AdaptedLinear(shared.q_proj, adapter(2 * d, q_width, s.attention_adapters))
        attention.k_proj = AdaptedLinear(shared.k_proj, adapter(2 * d, kv_width, s.attention_adapters))
        attention.v_proj = AdaptedLinear(shared.v_proj, adapter(2 * d, kv_width, s.attention_adapters))
        attention.o_proj = shared.o_proj
        self.attention = attention

    def forward(
        self,
        hidden: torch.Tensor,
        embeddings: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        static_shapes: bool = False,
    ) -> torch.Tensor:
        """hidden, embeddings [b, l, d] → T [b, l, d]; writes the new tokens' keys/values into `cache`.

        `static_shapes`: attention with shapes fixed by the cache's capacity (`Attention.forward_static`)."""
        # 1. Attention over the normalised [hidden, embeddings].
        x = self.input_norm(torch.cat([hidden, embeddings], dim=-1))
        attend = self.attention.forward_static if static_shapes else self.attention
        attended = self.tp.group.all_reduce_(attend(x, batch, cache))  # the norm below needs whole rows
        # 2. Gated-GELU MLP on its norm (no residual inside the block), then this use's projection.
        gate_up = self.gate_up_proj(self.pre_ff_norm(attended))
        return self.tp.group.all_reduce_(self.linear(self.down_proj(gelu_mul(gate_up, self.native))))

    def shard_rules(self) -> dict[str, ShardRule]:
        """The MLP's [gate | up] rows by rank (with its adapter's `up`), down_proj row-parallel; the attention
        (a submodule) states its own."""
        if not self.tp.parallel:
            return {}
        tp, local = self.tp, self.down_proj.in_features
        gate_up = column_parallel(
            "gate_up_proj", self.gate_up_proj, head_rows(tp, (local, 0), (local, local * tp.size))
        )
        return gate_up | row_parallel("down_proj", self.down_proj, share(tp, local))


def bind_shared_blocks(blocks: nn.ModuleList, config: HybridConfig) -> None:
    """Build the model's shared blocks and bind use i (the i-th SHARED_ATTENTION block) to block i mod num_blocks."""
    shared = [SharedTransformer(config) for _ in range(config.shared_block.num_blocks)]
    uses = [block.mixer for block in blocks if block.kind == SHARED_ATTENTION]
    for use_index, use in enumerate(uses):
        use.bind(shared[use_index % len(shared)], use_index)
