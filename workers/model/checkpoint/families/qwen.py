"""The Gated DeltaNet hybrids: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (VL wrapper or text-only). Config reader,
weight map and MTP head keys.

A decoder layer is two blocks: a Gated DeltaNet ("linear_attention") or gated full attention ("full_attention")
mixer, then a dense MLP or a MoE with a gated shared expert.

Weights live under `model.language_model.*` (vision-language wrapper; `model.visual.*` is ignored) or `model.*`
(text-only). Conversions done here, once, at load:
- Zero-centred RMSNorms (every one but the Gated DeltaNet's own) scale by (1 + w): we store 1 + w and run a plain
  RMSNorm.
- Gated DeltaNet projections become one `in_proj` with rows `[q | k | v | z | b | a]`: Qwen3.5's separate
  `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` concatenated; Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`,
  stored interleaved per key-head group (`[q dk | k dk | v r·dv | z r·dv]` and `[b r | a r]`, r = h_v / h_k),
  de-interleaved.
- Experts: per-expert `experts.E.{gate,up,down}_proj` stacked, or the fused `experts.gate_up_proj [E, 2I, H]`
  (gate rows first) and `experts.down_proj [E, H, I]` as they are.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from workers.model.checkpoint.config import (
    ATTENTION,
    GDN,
    MLP,
    MOE,
    AttentionConfig,
    FeedForwardConfig,
    GdnConfig,
    HybridConfig,
)
from workers.model.checkpoint.config_fields import common_fields, rope_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import Source, stacked_pairs

QWEN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
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


def _plus_one(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].float() + 1.0


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors)


def _deinterleave(gdn: GdnConfig, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Qwen3-Next's grouped `in_proj_qkvz` [h_k·(2dk + 2r·dv), d] and `in_proj_ba` [h_k·2r, d] → rows [q|k|v|z|b|a]."""
    qkvz, ba = tensors
    r = gdn.num_value_heads // gdn.num_key_heads
    width = qkvz.shape[-1]
    grouped = qkvz.view(gdn.num_key_heads, -1, width)
    q, k, v, z = grouped.split([gdn.key_head_dim, gdn.key_head_dim, r * gdn.value_head_dim, r * gdn.value_head_dim], 1)
    b, a = ba.view(gdn.num_key_heads, 2 * r, width).split([r, r], dim=1)
    return torch.cat([part.reshape(-1, width) for part in (q, k, v, z, b, a)])


def _norm(key: str, size: int) -> list[Source]:
    return [Source((key,), transform=_plus_one, shapes=((size,),))]


def _gdn_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    g, d = config.gdn, config.hidden_size
    split_keys = tuple(f"{hub}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
    split_shapes = ((g.conv_dim, d), (g.value_dim, d), (g.num_value_heads, d), (g.num_value_heads, d))
    grouped_keys = (f"{hub}.in_proj_qkvz.weight", f"{hub}.in_proj_ba.weight")
    grouped_shapes = ((g.conv_dim + g.value_dim, d), (2 * g.num_value_heads, d))
    sources = {
        "in_proj.weight": [
            Source(split_keys, transform=_cat, shapes=split_shapes),
            Source(grouped_keys, transform=partial(_deinterleave, g), shapes=grouped_shapes),
        ]
    }
    for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
        sources[name] = [Source((f"{hub}.{name}",))]
    return sources


def _attention_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    sources = {f"{p}_proj.{w}": [Source((f"{hub}.{p}_proj.{w}",))] for p in "qkvo" for w in ("weight", "bias")}
    for name in ("q_norm", "k_norm"):
        sources[f"{name}.weight"] = _norm(f"{hub}.{name}.weight", config.attention.head_dim)
    return sources


def _mlp_sources(hub: str) -> dict[str, list[Source]]:
    gate_up = (f"{hub}.gate_proj.weight", f"{hub}.up_proj.weight")
    return {"up_proj.weight": [Source(gate_up, "cat")], "down_proj.weight": [Source((f"{hub}.down_proj.weight",))]}


def _moe_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    num_experts = config.feed_forward.num_experts
    per_expert_gate_up = tuple(f"{hub}.experts.{e}.{p}_proj.weight" for e in range(num_experts) for p in ("gate", "up"))
    per_expert_down = tuple(f"{hub}.experts.{e}.down_proj.weight" for e in range(num_experts))
    sources = {
        "router.weight": [Source((f"{hub}.gate.weight",))],
        "experts_up": [stacked_pairs(per_expert_gate_up), Source((f"{hub}.experts.gate_up_proj",))],
        "experts_down": [Source(per_expert_down, "stack"), Source((f"{hub}.experts.down_proj",))],
        "shared_gate.weight": [Source((f"{hub}.shared_expert_gate.weight",))],
    }
    sources.update({f"shared.{k}": v for k, v in _mlp_sources(f"{hub}.shared_expert").items()})
    return sources


def _mtp_sources(config: HybridConfig) -> dict[str, list[Source]]:
    """The MTP head (`workers/model/layers/mtp.py`): `mtp.{fc, pre_fc_norm_*, layers.0.*, norm}`; its decoder layer is
    our blocks 0 (attention) and 1 (MLP or MoE)."""
    d, hub = config.hidden_size, "mtp.layers.0"
    sources = {"mtp.fc.weight": [Source(("mtp.fc.weight",))]}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sources[f"mtp.{name}.weight"] = _norm(f"mtp.{name}.weight", d)
    sources["mtp.blocks.0.norm.weight"] = _norm(f"{hub}.input_layernorm.weight", d)
    sources["mtp.blocks.1.norm.weight"] = _norm(f"{hub}.post_attention_layernorm.weight", d)
    attention = _attention_sources(config, f"{hub}.self_attn")
    ff = _moe_sources(config, f"{hub}.mlp") if config.feed_forward.num_experts else _mlp_sources(f"{hub}.mlp")
    sources.update({f"mtp.blocks.0.mixer.{name}": options for name, options in attention.items()})
    sources.update({f"mtp.blocks.1.mixer.{name}": options for name, options in ff.items()})
    return sources


def qwen_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name (but lm_head) → its candidate sources in a Qwen GDN-hybrid checkpoint."""
    wrapped = any(key.startswith("model.language_model.") for key in checkpoint_keys)
    prefix = "model.language_model" if wrapped else "model"
    d = config.hidden_size
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": [Source((f"{prefix}.embed_tokens.weight",))],
        "final_norm.weight": _norm(f"{prefix}.norm.weight", d),
    }
    for block, kind in enumerate(config.block_kinds):
        hub, ours = f"{prefix}.layers.{block // 2}", f"blocks.{block}"
        norm = "input_layernorm" if kind in (GDN, ATTENTION) else "post_attention_layernorm"
        sources[f"{ours}.norm.weight"] = _norm(f"{hub}.{norm}.weight", d)
        if kind == GDN:
            mixer = _gdn_sources(config, f"{hub}.linear_attn")
        elif kind == ATTENTION:
            mixer = _attention_sources(config, f"{hub}.self_attn")
        else:
            mixer = _mlp_sources(f"{hub}.mlp") if kind == MLP else _moe_sources(config, f"{hub}.mlp")
        sources.update({f"{ours}.mixer.{name}": options for name, options in mixer.items()})
    sources.update(_mtp_sources(config))  # read only when the model was built with its MTP head
    return sources


def qwen_mtp_head_keys(config: HybridConfig) -> list[str]:
    """The checkpoint keys that frame the Qwen MTP head: its projection, its norms, its decoder layer's norms."""
    layer = "mtp.layers.0"
    return [
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        f"{layer}.input_layernorm.weight",
        f"{layer}.post_attention_layernorm.weight",
        "mtp.norm.weight",
    ]


register(
    Family(
        model_types=QWEN_MODEL_TYPES,
        read_config=read_qwen,
        weight_sources=qwen_sources,
        mtp_head_keys=qwen_mtp_head_keys,
    )
)
