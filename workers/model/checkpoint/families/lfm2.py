"""Liquid's LFM2, LFM2-MoE and LFM3: config reader and weight map.

A decoder layer is two blocks: a gated short convolution ("conv") or attention ("full_attention"; LFM3 also
"sliding_attention"), then a SwiGLU MLP (`feed_forward.{w1 gate, w3 up, w2 down}`) or, in LFM2-MoE past its
`num_dense_layers` first layers, a MoE with sigmoid routing and an expert bias that only chooses the experts.
Norms are plain-weight RMSNorms (`operator_norm`, `ffn_norm`, the final `embedding_norm`; LFM3's sandwich norms
`post_operator_norm`, `post_ffn_norm`); attention norms each head of q and k (`q_layernorm` / `k_layernorm` in
LFM2, `q_norm` / `k_norm` in LFM3) and LFM2 names its output projection `out_proj`. Embeddings are tied unless
the config says otherwise (`tie_embedding` or `tie_word_embeddings`).

Config spellings of the published checkpoints: the layout comes from `layer_types`, else `full_attn_idxs` (LFM2
1.2B/700M/350M/2.6B carry both), else every layer is attention (transformers' default); the MLP width from
`block_ff_dim` (hub) or `intermediate_size`, adjusted as transformers' `Lfm2MLP` does when
`block_auto_adjust_ff_dim` (2/3, × `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`). LFM2-MoE and
LFM3 use `intermediate_size` as it is. LFM2-MoE experts: per expert `experts.E.{w1, w3, w2}.weight` (hub) or
transformers 5's fused `experts.gate_up_proj [E, 2I, d]` and `experts.down_proj [E, d, I]`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from workers.model.checkpoint.config import (
    ATTENTION,
    MLP,
    MOE,
    SHORT_CONV,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    ShortConvConfig,
)
from workers.model.checkpoint.config_fields import common_fields, first_present
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import Source, single, stacked_pairs

LFM_MODEL_TYPES = ("lfm2", "lfm2_moe", "lfm3")
_CONV, _FULL, _SLIDING = "conv", "full_attention", "sliding_attention"


def _layer_types(raw: dict[str, Any]) -> list[str]:
    """Each layer's type: `layer_types`, else from `full_attn_idxs`, else all attention (transformers' default)."""
    num_layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is None:
        attention = raw.get("full_attn_idxs")
        attention = range(num_layers) if attention is None else {int(i) for i in attention}
        layer_types = [_FULL if i in attention else _CONV for i in range(num_layers)]
    allowed = (_CONV, _FULL, _SLIDING) if raw["model_type"] == "lfm3" else (_CONV, _FULL)
    unknown = sorted({str(t) for t in layer_types if t not in allowed})
    if unknown:
        raise ValueError(f"unknown {raw['model_type']} layer types {unknown}; expected one of {list(allowed)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}")
    return list(layer_types)


def mlp_size(raw: dict[str, Any]) -> int:
    """The dense MLP's width as transformers' `Lfm2MLP` computes it (LFM2); LFM2-MoE and LFM3 take it as is."""
    size = int(first_present(raw, "block_ff_dim", "intermediate_size"))
    if raw["model_type"] != "lfm2" or not raw.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(raw.get("block_multiple_of", 256))
        size = int(multiplier * size)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def _rope(params: dict[str, Any], head_dim: int) -> tuple[float, int, int | None]:
    """(theta, rotary dims, rotated pairs of proportional RoPE or None) of one layer type's RoPE parameters."""
    rope_type = params.get("rope_type", "default")
    factor = float(params.get("factor", 1.0))
    if rope_type not in ("default", "proportional") or factor != 1.0:
        raise ValueError(f"unsupported rope_type {rope_type!r} (factor {factor}); supported: 'default', 'proportional'")
    theta = float(params.get("rope_theta", 1_000_000.0))
    partial_factor = float(params.get("partial_rotary_factor", 1.0))
    if rope_type == "proportional":
        return theta, head_dim, int(partial_factor * head_dim // 2)
    return theta, int(head_dim * partial_factor), None


def _attention(raw: dict[str, Any], layer_type: str) -> AttentionConfig:
    """The attention config of one layer type (LFM3 differs per type in RoPE and window)."""
    lfm3 = raw["model_type"] == "lfm3"
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    params = raw.get("rope_parameters") or {}
    if lfm3:
        default = {"rope_type": "default", "rope_theta": 10_000.0}
        if layer_type == _FULL:
            default = {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}
        params = params.get(layer_type, default) if params else default
    else:
        params = {"rope_theta": params.get("rope_theta", raw.get("rope_theta", 1_000_000.0)), **params}
    theta, rotary_dim, rope_pairs = _rope(params, head_dim)
    window = raw.get("sliding_window") if layer_type == _SLIDING else None
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        scale=head_dim**-0.5,
        bias=bool(raw.get("attention_bias", False)) if lfm3 else False,
        rope_theta=theta,
        rotary_dim=rotary_dim,
        qk_norm=True,
        head_gate=lfm3 and bool(raw.get("use_attention_gate", True)),
        sliding_window=None if window is None else int(window),
        rope_pairs=rope_pairs,
    )


def read_lfm2(raw: dict[str, Any]) -> dict[str, Any]:
    """HybridConfig fields (all but model_type) of an LFM2 / LFM2-MoE / LFM3 `config.json`."""
    model_type = raw["model_type"]
    layer_types = _layer_types(raw)
    num_experts = int(raw.get("num_experts") or 0) if model_type == "lfm2_moe" else 0
    num_dense = int(raw.get("num_dense_layers", 2)) if num_experts else len(layer_types)
    kinds, block_attention = [], []
    for layer, layer_type in enumerate(layer_types):
        kinds += [SHORT_CONV if layer_type == _CONV else ATTENTION, MOE if layer >= num_dense else MLP]
        block_attention += [None if layer_type == _CONV else _attention(raw, layer_type), None]
    attention_types = [t for t in layer_types if t != _CONV]
    fields = common_fields(raw)
    fields["tie_word_embeddings"] = bool(first_present(raw, "tie_embedding", "tie_word_embeddings", default=True))
    return {
        **fields,
        "block_kinds": tuple(kinds),
        "mamba": None,
        "short_conv": ShortConvConfig(conv_kernel=int(raw.get("conv_L_cache", 3)), bias=bool(raw.get("conv_bias"))),
        # The model-wide attention config (KV cache shapes); each attention block carries its own.
        "attention": _attention(raw, attention_types[0] if attention_types else _FULL),
        "block_attention": tuple(block_attention),
        "feed_forward": FeedForwardConfig(
            intermediate_size=mlp_size(raw),
            gated=True,
            bias=False,
            num_experts=num_experts,
            experts_per_token=int(raw.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            router="sigmoid",
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            topk_norm_eps=1e-6,
        ),
        "rms_norm_eps": float(first_present(raw, "norm_eps", "rms_norm_eps", default=1e-5)),
        "sandwich_norms": model_type == "lfm3" and bool(raw.get("use_sandwich_norm", True)),
    }


def _zeros(shape: tuple[int, ...], tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.zeros(shape)


def _mlp_sources(hub: str) -> dict[str, list[Source]]:
    return {
        "up_proj.weight": [Source((f"{hub}.w1.weight", f"{hub}.w3.weight"), "cat")],
        "down_proj.weight": single(f"{hub}.w2.weight"),
    }


def _moe_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    num_experts = config.feed_forward.num_experts
    w1_w3 = tuple(f"{hub}.experts.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w3"))
    w2 = tuple(f"{hub}.experts.{e}.w2.weight" for e in range(num_experts))
    return {
        "router.weight": single(f"{hub}.gate.weight"),
        # Without `use_expert_bias` the checkpoint has none: a zero bias chooses the same experts.
        "router.e_score_correction_bias": [
            Source((f"{hub}.expert_bias",)),
            Source((), transform=partial(_zeros, (num_experts,))),
        ],
        "experts_up": [stacked_pairs(w1_w3), Source((f"{hub}.experts.gate_up_proj",))],
        "experts_down": [Source(w2, "stack"), Source((f"{hub}.experts.down_proj",))],
    }


def _attention_sources(hub: str) -> dict[str, list[Source]]:
    sources = {f"{p}_proj.{w}": single(f"{hub}.{p}_proj.{w}") for p in "qkv" for w in ("weight", "bias")}
    sources.update({f"o_proj.{w}": single(f"{hub}.out_proj.{w}", f"{hub}.o_proj.{w}") for w in ("weight", "bias")})
    sources["q_norm.weight"] = single(f"{hub}.q_layernorm.weight", f"{hub}.q_norm.weight")
    sources["k_norm.weight"] = single(f"{hub}.k_layernorm.weight", f"{hub}.k_norm.weight")
    sources["g_proj.weight"] = single(f"{hub}.g_proj.weight", f"{hub}.gate_proj.weight")  # LFM3 (hub: gate_proj)
    return sources


def _conv_sources(hub: str) -> dict[str, list[Source]]:
    sources = {f"conv1d.{w}": single(f"{hub}.conv.{w}") for w in ("weight", "bias")}
    sources.update({f"{p}.{w}": single(f"{hub}.{p}.{w}") for p in ("in_proj", "out_proj") for w in ("weight", "bias")})
    return sources


def lfm2_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name (but lm_head) → its candidate sources in an LFM2 / LFM2-MoE / LFM3 checkpoint."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.embedding_norm.weight"),
    }
    for block, kind in enumerate(config.block_kinds):
        hub, ours = f"model.layers.{block // 2}", f"blocks.{block}"
        first = block % 2 == 0
        sources[f"{ours}.norm.weight"] = single(f"{hub}.{'operator_norm' if first else 'ffn_norm'}.weight")
        sources[f"{ours}.post_norm.weight"] = single(
            f"{hub}.{'post_operator_norm' if first else 'post_ffn_norm'}.weight"
        )
        if kind == SHORT_CONV:
            mixer = _conv_sources(f"{hub}.conv")
        elif kind == ATTENTION:
            mixer = _attention_sources(f"{hub}.self_attn")
        else:
            mixer = _mlp_sources(f"{hub}.feed_forward") if kind == MLP else _moe_sources(config, f"{hub}.feed_forward")
        sources.update({f"{ours}.mixer.{name}": options for name, options in mixer.items()})
    return sources


register(Family(model_types=LFM_MODEL_TYPES, read_config=read_lfm2, weight_sources=lfm2_sources))
