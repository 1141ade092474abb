"""Attention-only standard models — Llama, Mistral, Qwen2, Qwen3, Granite (dense) — as `HybridConfig`s without
recurrent blocks: the natural draft models for hybrid targets of the same tokenizer (dense Granite for Granite
4.0-H, Qwen3 for Qwen3.5), and targets where it costs nothing.

Each decoder layer is two blocks: attention, then a SwiGLU MLP. What differs between the families:
- Qwen2: q/k/v projections with bias, o_proj without. Qwen3: per-head RMSNorm of q and k (plain weights).
- Granite: μP multipliers (embedding, attention scale, residual, logits divisor).
- Mistral / Qwen sliding windows: hybridgen's attention is full; a model whose attention slides over a window
  runs exactly up to that window, so `max_position_embeddings` (the default max_model_len) is capped at it.
"""

from __future__ import annotations

from typing import Any

from workers.model.checkpoint.config import (
    ATTENTION,
    MLP,
    AttentionConfig,
    FeedForwardConfig,
    common_fields,
    rope_fields,
)


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
