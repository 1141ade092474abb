"""Attention-only standard models — Llama, Mistral, Qwen2, Qwen3, Granite (dense) — as `HybridConfig`s without
recurrent blocks: the natural draft models for hybrid targets of the same tokenizer (dense Granite for Granite
4.0-H, Qwen3 for Qwen3.5), and targets where it costs nothing. Config reader and weight map.

Each decoder layer is two blocks: attention, then a SwiGLU MLP. What differs between the families:
- Qwen2: q/k/v projections with bias, o_proj without. Qwen3: per-head RMSNorm of q and k (plain weights).
- Granite: μP multipliers (embedding, attention scale, residual, logits divisor).
- Mistral / Qwen sliding windows: hybridgen's attention is full; a model whose attention slides over a window
  runs exactly up to that window, so `max_position_embeddings` (the default max_model_len) is capped at it.
"""

from __future__ import annotations

from typing import Any

from workers.model.checkpoint.config import ATTENTION, MLP, AttentionConfig, FeedForwardConfig, HybridConfig
from workers.model.checkpoint.config_fields import common_fields, rope_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import ATTENTION_PARAMS, Source, single

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")  # attention-only (drafts, mostly)


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window when the model slides one, else None."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    layer_types = raw.get("layer_types") or []
    if raw.get("model_type") in ("qwen2", "qwen3"):
        slides = bool(raw.get("use_sliding_window")) or "sliding_attention" in layer_types
        return int(window) if slides else None
    return int(window)


def read_dense(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of an attention-only model's `config.json`."""
    model_type = raw["model_type"]
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported {model_type} hidden_act {raw.get('hidden_act')!r}; supported: 'silu'")
    num_layers, num_heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    theta, rotary_dim = rope_fields(raw, head_dim, 1.0)
    granite = model_type == "granite"
    qkv_bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
    fields = common_fields(raw)
    window = _sliding_window(raw)
    if window is not None:
        fields["max_position_embeddings"] = min(fields["max_position_embeddings"], window)
    return {
        **fields,
        "block_kinds": (ATTENTION, MLP) * num_layers,
        "mamba": None,
        "attention": AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=float(raw.get("attention_multiplier", 1.0)) if granite else head_dim**-0.5,
            bias=qkv_bias,
            output_bias=bool(raw.get("attention_bias", False)),
            rope_theta=theta,
            rotary_dim=rotary_dim,
            qk_norm=model_type == "qwen3",
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw["intermediate_size"]), gated=True, bias=bool(raw.get("mlp_bias", False))
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)) if granite else 1.0,
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)) if granite else 1.0,
        "logits_divisor": float(raw.get("logits_scaling", 1.0)) if granite else 1.0,
    }


def dense_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Llama-style attention-only models: `model.layers.N.{input_layernorm, self_attn, post_attention_layernorm,
    mlp}`, two blocks per decoder layer (attention, then the MLP with gate and up fused)."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.norm.weight"),
    }
    for layer in range(len(config.block_kinds) // 2):
        hub, attention, mlp = f"model.layers.{layer}", f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}"
        sources[f"{attention}.norm.weight"] = single(f"{hub}.input_layernorm.weight")
        for name in (*ATTENTION_PARAMS, "q_norm.weight", "k_norm.weight"):
            sources[f"{attention}.mixer.{name}"] = single(f"{hub}.self_attn.{name}")
        sources[f"{mlp}.norm.weight"] = single(f"{hub}.post_attention_layernorm.weight")
        for w in ("weight", "bias"):
            sources[f"{mlp}.mixer.up_proj.{w}"] = [
                Source((f"{hub}.mlp.gate_proj.{w}", f"{hub}.mlp.up_proj.{w}"), "cat")
            ]
            sources[f"{mlp}.mixer.down_proj.{w}"] = single(f"{hub}.mlp.down_proj.{w}")
    return sources


register(Family(model_types=DENSE_MODEL_TYPES, read_config=read_dense, weight_sources=dense_sources))
