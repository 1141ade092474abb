"""The attention-like mixers and MoE of a T = 2 layer test: tiny configs, seeded full weights, and the runs.

Each case builds the unsplit layer (the oracle) and this rank's layer from the same seeded state dict, cut by the
layer's own `shard_rules` (`cut_state_dict`), runs the same inputs through both, all-reduces the rank's partial
output and measures how far it lies from the oracle's; states and KV caches are compared slice by slice (each rank
against its cut of the oracle's, the same as comparing the ranks' concatenation). Every run returns
`[(check, max abs error)]`; the test asserts them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from workers.model.checkpoint.config import (
    ATTENTION,
    GDN,
    KDA,
    MOE,
    SHARED_ATTENTION,
    AttentionConfig,
    FeedForwardConfig,
    GdnConfig,
    HybridConfig,
    KdaConfig,
    MlaConfig,
    SharedBlockConfig,
)
from workers.model.distributed.layout import TensorParallel, check_divisible, shard_config
from workers.model.distributed.slices import cut_state_dict
from workers.model.kv_blocks import BlockTable
from workers.model.state import ForwardBatch, KVCache

D = 32
ATTN = AttentionConfig(4, 2, 8, 8**-0.5, False, 10000.0, 8)
FF = FeedForwardConfig(intermediate_size=32, gated=True, bias=False)
MOE_FF = dataclasses.replace(
    FF, num_experts=8, experts_per_token=2, expert_intermediate_size=16, shared_expert_intermediate_size=16
)
BASE = HybridConfig("tp-test", 64, D, (ATTENTION,), None, ATTN, FF, 1e-6)
TOLERANCE = 1e-5
MIN_ROUTER_MARGIN = 1e-4


def attention_config(**changes) -> HybridConfig:
    """A one-attention-layer config with `changes` to its attention."""
    return dataclasses.replace(BASE, attention=dataclasses.replace(ATTN, **changes))


CONFIGS: dict[str, tuple[HybridConfig, bool]] = {  # (global config, expert parallel)
    "attention, output gate, per-head qk norm, partial rope, bias": (
        attention_config(output_gate=True, qk_norm=True, rotary_dim=4, bias=True),
        False,
    ),
    "attention, replicated kv (kv = 1)": (attention_config(num_kv_heads=1), False),
    "attention, OLMo full-width qk norm, NoPE": (
        attention_config(qk_norm=True, qk_norm_full_width=True, rope_theta=None),
        False,
    ),
    "attention, LFM3 head gate, sliding window": (
        attention_config(head_gate=True, sliding_window=3, qk_norm=True, output_bias=True),
        False,
    ),
    "gated deltanet": (dataclasses.replace(BASE, block_kinds=(GDN,), gdn=GdnConfig(2, 4, 8, 8, 4)), False),
    "kda": (dataclasses.replace(BASE, block_kinds=(KDA,), kda=KdaConfig(4, 8, 4)), False),
    "mla": (
        dataclasses.replace(
            BASE,
            mla=MlaConfig(4, 16, 16, 8, 4, 8, True),
            attention=dataclasses.replace(ATTN, num_kv_heads=1, head_dim=20, cache_value_dim=0),
        ),
        False,
    ),
    "moe tp, softmax, gated shared expert": (
        dataclasses.replace(
            BASE, block_kinds=(MOE,), feed_forward=dataclasses.replace(MOE_FF, shared_expert_gate=True)
        ),
        False,
    ),
    "moe tp, sigmoid grouped with score bias, biases": (
        dataclasses.replace(
            BASE,
            block_kinds=(MOE,),
            feed_forward=dataclasses.replace(
                MOE_FF, router="sigmoid", num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, bias=True
            ),
        ),
        False,
    ),
    "moe ep, softmax, gated shared expert": (
        dataclasses.replace(
            BASE, block_kinds=(MOE,), feed_forward=dataclasses.replace(MOE_FF, shared_expert_gate=True)
        ),
        True,
    ),
    "moe ep, sigmoid, Nemotron latent, relu², biases": (
        dataclasses.replace(
            BASE,
            block_kinds=(MOE,),
            feed_forward=dataclasses.replace(
                MOE_FF,
                gated=False,
                router="sigmoid",
                num_expert_groups=2,
                latent_size=16,
                bias=True,
                shared_expert_intermediate_size=0,
            ),
        ),
        True,
    ),
    "mtp head (attention + moe)": (
        dataclasses.replace(BASE, mtp_block_kinds=(ATTENTION, MOE), feed_forward=MOE_FF),
        False,
    ),
    "zamba2 shared block use, adapters": (
        dataclasses.replace(
            BASE,
            block_kinds=(SHARED_ATTENTION,),
            attention=dataclasses.replace(ATTN, num_kv_heads=4),
            shared_block=SharedBlockConfig(1, 32, True, 4, True, True),
        ),
        False,
    ),
}


def seeded_state(layer: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random full weights: norms near 1, everything else small (the state dict the ranks are cut from)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in layer.state_dict().items():
        noise = torch.randn(tensor.shape, generator=g)
        state[name] = 1.0 + 0.1 * noise if "norm" in name else 0.3 * noise
    return state


def build(config: HybridConfig, tp: TensorParallel) -> nn.Module:
    """The layer of `config`'s one block for `tp`, from the rank's local config (`shard_config`)."""
    from workers.model.layers.block import Block
    from workers.model.layers.mtp import MtpHead

    local = shard_config(config, tp)
    if config.mtp_block_kinds:
        return MtpHead(local, tp=tp)
    block = Block(local, config.block_kinds[0], tp=tp)
    layer = block.mixer
    if config.shared_block is not None:
        from workers.model.layers.shared_block import SharedTransformer

        layer.bind(SharedTransformer(local), 0)
    return layer


def pair(config: HybridConfig, tp: TensorParallel, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(the oracle layer, this rank's layer), loaded from the same seeded full state dict."""
    check_divisible(config, tp.size, tp.expert_parallel)
    full = build(config, TensorParallel())
    full_state = seeded_state(full, seed)
    full.load_state_dict(full_state)
    mine = build(config, tp)
    mine.load_state_dict(cut_state_dict(mine, full_state, tp.rank))
    return full.eval(), mine.eval()


def error(expected: torch.Tensor, got: torch.Tensor) -> float:
    """Max abs difference (inf when the shapes differ, 0 for empty tensors: a latent cache's values)."""
    if expected.shape != got.shape:
        return float("inf")
    return float((expected - got).abs().max()) if expected.numel() else 0.0


def narrow(tensor: torch.Tensor, dim: int, pieces) -> torch.Tensor:
    """The pieces `(start, length)` of `tensor` along `dim`, concatenated."""
    return torch.cat([tensor.narrow(dim, start, length) for start, length in pieces], dim=dim)


def caches(heads: int, width: int, value_width: int, slots: int = 3, capacity: int = 16) -> KVCache:
    """An empty paged KV cache of `heads` heads for `slots` slots."""
    blocks = BlockTable.fully_assigned(slots, capacity, 4, torch.device("cpu"))
    tokens = blocks.num_blocks * blocks.block_size
    return KVCache(torch.zeros(heads, tokens, width), torch.zeros(heads, tokens, value_width), blocks)


STEPS = (  # (cache_lens, num_tokens, length, one token each): prefill (ragged), decode, verification k = 3
    ([0, 0, 0], [5, 3, 4], 5, False),
    ([5, 3, 4], [1, 1, 1], 1, True),
    ([6, 4, 5], [4, 4, 4], 4, False),
)


def batches():
    """The three steps' batches over slots 0, 1, 2."""
    for lens, counts, length, one in STEPS:
        yield ForwardBatch(torch.arange(3), torch.tensor(lens), torch.tensor(counts), True, one), length
