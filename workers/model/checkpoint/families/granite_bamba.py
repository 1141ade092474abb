"""Granite 4.0-H and Bamba (IBM's Mamba2 hybrids): config reader and weight map.

A decoder layer is two blocks, a sequence mixer (Mamba2 or attention), then a feed-forward block: Granite 4.0-H's
shared MLP (with a MoE when it has experts), Bamba's MLP. Weights live under `model.layers.N.*`.
"""

from __future__ import annotations

from typing import Any

from workers.model.checkpoint.config import (
    ATTENTION,
    MAMBA,
    MLP,
    MOE,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    MambaConfig,
)
from workers.model.checkpoint.config_fields import common_fields, dt_limits, layer_kinds, rope_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import ATTENTION_PARAMS, MAMBA_PARAMS, Source, single


def _mamba_ibm(raw: dict[str, Any]) -> MambaConfig:
    """Mamba fields as Granite 4.0-H and Bamba name them."""
    num_heads = int(raw["mamba_n_heads"])
    head_dim = raw.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = int(raw.get("mamba_expand", 2)) * int(raw["hidden_size"]) // num_heads
    dt_min, dt_max = dt_limits(raw)
    return MambaConfig(
        num_heads=num_heads,
        head_dim=int(head_dim),
        state_size=int(raw.get("mamba_d_state", 256)),
        num_groups=int(raw.get("mamba_n_groups", 1)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=dt_min,
        dt_max=dt_max,
    )


def _attention_ibm(raw: dict[str, Any], scale: float | None, rope: bool, partial: float) -> AttentionConfig:
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    theta, rotary_dim = rope_fields(raw, head_dim, partial) if rope else (None, 0)
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        scale=head_dim**-0.5 if scale is None else float(scale),
        bias=bool(raw.get("attention_bias", False)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
    )


def read_granite(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of a Granite 4.0-H `config.json`."""
    layer_types = raw.get("layer_types") or raw.get("layers_block_type")
    if layer_types is None:
        layer_types = ["mamba"] * int(raw["num_hidden_layers"])
    kinds = []
    for kind in layer_kinds(layer_types):
        kinds += [kind, MLP]  # sequence mixer, then the (shared MLP + MoE) feed-forward block
    num_experts = int(raw.get("num_local_experts") or 0)
    if num_experts:
        kinds = [MOE if k == MLP else k for k in kinds]
    return {
        **common_fields(raw),
        "block_kinds": tuple(kinds),
        "mamba": _mamba_ibm(raw),
        "attention": _attention_ibm(
            raw, raw.get("attention_multiplier", 1.0), raw.get("position_embedding_type") == "rope", 1.0
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
            gated=True,
            bias=False,
            num_experts=num_experts,
            experts_per_token=int(raw.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(raw.get("intermediate_size", 0)),
            shared_expert_intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
            router="softmax",
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "logits_divisor": float(raw.get("logits_scaling", 1.0)),
    }


def read_bamba(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of a Bamba `config.json`."""
    attention_layers = set(raw.get("attn_layer_indices") or [])
    kinds = []
    for i in range(int(raw["num_hidden_layers"])):
        kinds += [ATTENTION if i in attention_layers else MAMBA, MLP]
    return {
        **common_fields(raw),
        "block_kinds": tuple(kinds),
        "mamba": _mamba_ibm(raw),
        "attention": _attention_ibm(raw, None, True, 0.5),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw["intermediate_size"]), gated=True, bias=bool(raw.get("mlp_bias", False))
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
    }


def granite_bamba_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Granite 4.0-H and Bamba: `model.layers.N.*`, two blocks per decoder layer."""
    bamba = config.model_type == "bamba"
    sources: dict[str, list[Source]] = {"embed_tokens.weight": single("model.embed_tokens.weight")}
    sources["final_norm.weight"] = single("model.final_layernorm.weight" if bamba else "model.norm.weight")
    for block, kind in enumerate(config.block_kinds):
        layer, ours_prefix = block // 2, f"blocks.{block}"
        hub = f"model.layers.{layer}"
        if kind in (MAMBA, ATTENTION):
            sources[f"{ours_prefix}.norm.weight"] = single(f"{hub}.input_layernorm.weight")
            names, sub = (MAMBA_PARAMS, "mamba") if kind == MAMBA else (ATTENTION_PARAMS, "self_attn")
            for name in names:
                sources[f"{ours_prefix}.mixer.{name}"] = single(f"{hub}.{sub}.{name}")
            continue
        sources[f"{ours_prefix}.norm.weight"] = single(
            f"{hub}.{'pre_ff_layernorm' if bamba else 'post_attention_layernorm'}.weight"
        )
        mlp = f"{ours_prefix}.mixer" if kind == MLP else f"{ours_prefix}.mixer.shared"
        if bamba:
            ff = f"{hub}.feed_forward"
            sources[f"{mlp}.up_proj.weight"] = [Source((f"{ff}.gate_proj.weight", f"{ff}.up_proj.weight"), "cat")]
            sources[f"{mlp}.up_proj.bias"] = [Source((f"{ff}.gate_proj.bias", f"{ff}.up_proj.bias"), "cat")]
            sources[f"{mlp}.down_proj.weight"] = single(f"{ff}.down_proj.weight")
            sources[f"{mlp}.down_proj.bias"] = single(f"{ff}.down_proj.bias")
        else:
            sources[f"{mlp}.up_proj.weight"] = single(f"{hub}.shared_mlp.input_linear.weight")
            sources[f"{mlp}.down_proj.weight"] = single(f"{hub}.shared_mlp.output_linear.weight")
        moe = f"{hub}.block_sparse_moe"
        sources[f"{ours_prefix}.mixer.router.weight"] = single(f"{moe}.router.layer.weight")
        sources[f"{ours_prefix}.mixer.experts_up"] = single(f"{moe}.input_linear.weight", f"{moe}.experts.gate_up_proj")
        sources[f"{ours_prefix}.mixer.experts_down"] = single(f"{moe}.output_linear.weight", f"{moe}.experts.down_proj")
    return sources


register(Family(model_types=("granitemoehybrid",), read_config=read_granite, weight_sources=granite_bamba_sources))
register(Family(model_types=("bamba",), read_config=read_bamba, weight_sources=granite_bamba_sources))
