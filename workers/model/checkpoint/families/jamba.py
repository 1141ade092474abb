"""Jamba (AI21: Jamba-v0.1, Jamba 1.5 Mini / Large, Jamba Reasoning 3B, Jamba2): config reader and weight map.

A decoder layer is two blocks: a sequence mixer — attention where `i % attn_layer_period == attn_layer_offset`, else
Mamba version 1 — then a feed-forward block — a MoE where `i % expert_layer_period == expert_layer_offset` and the
model has more than one expert, else a dense SwiGLU MLP. The two schedules are independent (an attention layer may
carry a MoE). Attention has no positional encoding and no biases; the MoE router is a softmax over all experts whose
top-k weights are not renormalised, with no shared expert. Weights live under `model.layers.N.{input_layernorm,
mamba.* | self_attn.*, pre_ff_layernorm, feed_forward.*}`; experts per expert (`experts.E.{gate,up,down}_proj`,
as the hub and transformers' `save_pretrained` store them) or fused (`experts.gate_up_proj [E, 2I, H]`, gate rows
first, and `experts.down_proj [E, H, I]`).

transformers computes the layer schedule from the period / offset fields (`layers_block_type` is a property, not a
stored field) and ignores `use_mamba_kernels` (a kernel choice), the legacy `mamba_inner_layernorms`, `n_ctx` and
`calc_logits_for_entire_prompt` of the remote-code configs; so do we, but an explicitly listed schedule that
disagrees with the periods is refused rather than guessed at.
"""

from __future__ import annotations

import math
from typing import Any

from workers.model.checkpoint.config import (
    ATTENTION,
    MAMBA1,
    MLP,
    MOE,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    Mamba1Config,
)
from workers.model.checkpoint.config_fields import common_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import ATTENTION_PARAMS, Source, single, stacked_pairs

MAMBA1_PARAMS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                 "dt_proj.bias", "A_log", "D", "out_proj.weight", "out_proj.bias", "dt_layernorm.weight",
                 "b_layernorm.weight", "c_layernorm.weight")  # fmt: skip
_LISTED_MIXERS = {"mamba": MAMBA1, "linear_attention": MAMBA1, "attention": ATTENTION, "full_attention": ATTENTION}


def _period(raw: dict[str, Any], name: str, default_period: int, default_offset: int) -> tuple[int, int]:
    """(period, offset) of the `{name}_layer_period` / `{name}_layer_offset` schedule, checked as transformers does."""
    period = int(raw.get(f"{name}_layer_period", default_period))
    offset = int(raw.get(f"{name}_layer_offset", default_offset))
    if period < 1 or not 0 <= offset < period:
        raise ValueError(f"{name}_layer_offset ({offset}) must lie in [0, {name}_layer_period ({period}))")
    return period, offset


def layer_mixers(raw: dict[str, Any]) -> list[str]:
    """Each layer's sequence mixer, ATTENTION or MAMBA1, from the attention period and offset."""
    period, offset = _period(raw, "attn", 8, 4)
    mixers = [ATTENTION if i % period == offset else MAMBA1 for i in range(int(raw["num_hidden_layers"]))]
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed is not None:
        kinds = [_LISTED_MIXERS.get(str(name).lower()) for name in listed]
        if kinds != mixers:
            raise ValueError(
                f"the listed layer types {listed} disagree with attn_layer_period={period}, "
                f"attn_layer_offset={offset} (transformers builds the layers from the period and offset)"
            )
    return mixers


def layer_feed_forwards(raw: dict[str, Any]) -> list[str]:
    """Each layer's feed-forward, MOE or MLP: a MoE on the expert schedule when the model has experts (> 1)."""
    period, offset = _period(raw, "expert", 2, 1)
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 16)))
    return [MOE if num_experts > 1 and i % period == offset else MLP for i in range(int(raw["num_hidden_layers"]))]


def read_jamba(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of a Jamba `config.json`."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported for jamba; supported: 'silu'")
    hidden = int(raw["hidden_size"])
    dt_rank = raw.get("mamba_dt_rank", "auto")
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    kinds = []
    for mixer, feed_forward in zip(layer_mixers(raw), layer_feed_forwards(raw), strict=True):
        kinds += [mixer, feed_forward]
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 16)))
    intermediate = int(raw.get("intermediate_size", 14336))
    fields = common_fields(raw)
    fields["max_position_embeddings"] = int(raw.get("max_position_embeddings") or raw.get("n_ctx") or 262144)
    return {
        **fields,
        "block_kinds": tuple(kinds),
        "mamba": None,
        "mamba1": Mamba1Config(
            intermediate_size=int(raw.get("mamba_expand", 2)) * hidden,
            state_size=int(raw.get("mamba_d_state", 16)),
            conv_kernel=int(raw.get("mamba_d_conv", 4)),
            dt_rank=math.ceil(hidden / 16) if dt_rank in (None, "auto") else int(dt_rank),
            conv_bias=bool(raw.get("mamba_conv_bias", True)),
            proj_bias=bool(raw.get("mamba_proj_bias", False)),
        ),
        "attention": AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            bias=False,
            rope_theta=None,  # Jamba's attention has no positional encoding
            rotary_dim=0,
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=intermediate,
            gated=True,
            bias=False,
            num_experts=num_experts if MOE in kinds else 0,
            experts_per_token=int(raw.get("num_experts_per_tok", 2)) if MOE in kinds else 0,
            expert_intermediate_size=intermediate,
            shared_expert_intermediate_size=0,
            router="softmax",
            norm_topk_prob=False,  # top-k of a softmax over all experts, not renormalised
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
    }


def _moe_sources(config: HybridConfig, hub: str, ours: str) -> dict[str, list[Source]]:
    """A Jamba MoE `hub.{router, experts}` → our `ours.{router, experts_up, experts_down}`; per-expert keys carry
    their expected shapes, so a mis-shaped expert tensor is named before anything is read."""
    ff, d = config.feed_forward, config.hidden_size
    num, width = ff.num_experts, ff.expert_intermediate_size
    gate_up = tuple(f"{hub}.experts.{e}.{p}_proj.weight" for e in range(num) for p in ("gate", "up"))
    down = tuple(f"{hub}.experts.{e}.down_proj.weight" for e in range(num))
    return {
        f"{ours}.router.weight": single(f"{hub}.router.weight"),
        f"{ours}.experts_up": [
            stacked_pairs(gate_up, shapes=((width, d),) * len(gate_up)),
            Source((f"{hub}.experts.gate_up_proj",), shapes=((num, 2 * width, d),)),
        ],
        f"{ours}.experts_down": [
            Source(down, "stack", shapes=((d, width),) * num),
            Source((f"{hub}.experts.down_proj",), shapes=((num, d, width),)),
        ],
    }


def jamba_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Jamba: `model.layers.N.*`, two blocks per decoder layer (mixer, feed-forward)."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.final_layernorm.weight"),
    }
    for block, kind in enumerate(config.block_kinds):
        ours, hub = f"blocks.{block}", f"model.layers.{block // 2}"
        if kind in (MAMBA1, ATTENTION):
            sources[f"{ours}.norm.weight"] = single(f"{hub}.input_layernorm.weight")
            names, sub = (MAMBA1_PARAMS, "mamba") if kind == MAMBA1 else (ATTENTION_PARAMS, "self_attn")
            sources.update({f"{ours}.mixer.{name}": single(f"{hub}.{sub}.{name}") for name in names})
            continue
        sources[f"{ours}.norm.weight"] = single(f"{hub}.pre_ff_layernorm.weight")
        ff = f"{hub}.feed_forward"
        if kind == MOE:
            sources.update(_moe_sources(config, ff, f"{ours}.mixer"))
            continue
        gate_up = (f"{ff}.gate_proj.weight", f"{ff}.up_proj.weight")
        shape = (config.feed_forward.intermediate_size, config.hidden_size)
        sources[f"{ours}.mixer.up_proj.weight"] = [Source(gate_up, "cat", shapes=(shape, shape))]
        sources[f"{ours}.mixer.down_proj.weight"] = single(f"{ff}.down_proj.weight")
    return sources


register(Family(model_types=("jamba",), read_config=read_jamba, weight_sources=jamba_sources))
