"""Config reader of the Gated DeltaNet hybrids: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (VL wrapper or text-only).

A decoder layer is two blocks: a Gated DeltaNet ("linear_attention") or gated full attention ("full_attention")
mixer, then a dense MLP or a MoE with a gated shared expert. Every RMSNorm but the Gated DeltaNet's own scales by
(1 + w); the loader stores 1 + w, so the model's norms are plain ones.
"""

from __future__ import annotations

from typing import Any

from workers.model.checkpoint.config import (
    ATTENTION,
    GDN,
    MLP,
    MOE,
    AttentionConfig,
    FeedForwardConfig,
    GdnConfig,
    common_fields,
    rope_fields,
)

_WRAPPER_FIELDS = ("tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id", "bos_token_id")


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of a vision-language wrapper (with the wrapper's own tying,
    dtype and special tokens when it sets them), or the config itself for text-only checkpoints."""
    text = raw.get("text_config")
    if text is None:
        return raw
    return {**text, **{k: raw[k] for k in _WRAPPER_FIELDS if raw.get(k) is not None}}


def _layer_types(text: dict[str, Any]) -> list[str]:
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(text["num_hidden_layers"]))
        ]
    unknown = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise ValueError(f"unknown layer types {unknown}; expected 'linear_attention' or 'full_attention'")
    return list(layer_types)


def _is_moe_layer(model_type: str, text: dict[str, Any], layer: int) -> bool:
    if model_type.startswith("qwen3_5_moe"):
        return True
    if model_type != "qwen3_next" or not int(text.get("num_experts") or 0):
        return False
    sparse_step = int(text.get("decoder_sparse_step") or 1)
    return layer not in (text.get("mlp_only_layers") or []) and (layer + 1) % sparse_step == 0


def read_qwen(raw: dict[str, Any]) -> dict[str, Any]:
    """HybridConfig fields (all but model_type) of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE `config.json`."""
    model_type = str(raw["model_type"])
    text = text_fields(raw)
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported {model_type} hidden_act {text.get('hidden_act')!r}; supported: 'silu'")
    kinds = []
    for layer, layer_type in enumerate(_layer_types(text)):
        kinds.append(GDN if layer_type == "linear_attention" else ATTENTION)
        kinds.append(MOE if _is_moe_layer(model_type, text, layer) else MLP)
    num_key_heads, num_value_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    if num_value_heads % num_key_heads:
        raise ValueError(
            f"linear_num_value_heads={num_value_heads} must be a multiple of linear_num_key_heads={num_key_heads}"
        )
    num_heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // num_heads)
    theta, rotary_dim = rope_fields(text, head_dim, 0.25)
    num_experts = int(text.get("num_experts") or 0)
    return {
        **common_fields(text),
        "block_kinds": tuple(kinds),
        "mamba": None,
        "gdn": GdnConfig(
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
            key_head_dim=int(text["linear_key_head_dim"]),
            value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        ),
        "attention": AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            bias=bool(text.get("attention_bias", False)),
            rope_theta=theta,
            rotary_dim=rotary_dim,
            output_gate=True,
            qk_norm=True,
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(text.get("intermediate_size") or 0),
            gated=True,
            bias=False,
            num_experts=num_experts,
            experts_per_token=int(text.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            router="softmax",
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            shared_expert_gate=True,
        ),
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "zero_centred_norms": True,
        # One full-attention decoder layer; its feed-forward is a MoE whenever the model has experts.
        "mtp_block_kinds": (ATTENTION, MOE if num_experts else MLP),
        "mtp_num_layers": int(text.get("mtp_num_hidden_layers") or 1),
    }
