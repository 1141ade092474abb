"""AI2's OLMo-Hybrid (`olmo_hybrid`, e.g. allenai/Olmo-Hybrid-7B): Gated DeltaNet layers and OLMo 3 attention
layers. Config reader and weight map.

A decoder layer is two blocks: a Gated DeltaNet ("linear_attention") or full attention ("full_attention") mixer,
then a SwiGLU MLP. What differs from the Qwen Gated DeltaNet hybrids (transformers' `modeling_olmo_hybrid.py`):
- Gated DeltaNet layers are pre-norm (`input_layernorm`, `post_attention_layernorm`; the hub's OLMo-core names are
  `attention_layer_norm`, `feedforward_layer_norm`); attention layers are OLMo 3's post-norm ones,
  `x + post_attention_layernorm(attn(x))` then `x + post_feedforward_layernorm(mlp(x))`. Plain RMSNorm weights.
- Separate `q/k/v/g/b/a_proj` (g is the output gate z), joined here into our `in_proj` rows `[q | k | v | z | b | a]`;
  the causal conv is one `conv1d` or the hub's `q_conv1d`, `k_conv1d`, `v_conv1d` concatenated (transformers 5.25
  saves those three as equal chunks of the fused conv, not as q / k / v widths: only their concatenation counts).
- beta = 2 · sigmoid(b) when `linear_allow_neg_eigval` (the default), the gated output norm `o_norm` has eps 1e-5
  (FLA's default) whatever `rms_norm_eps` says, and `o_proj` is the output projection.
- Attention: no output gate, one RMSNorm over the whole q (k) projection, no sliding window; RoPE only when
  `rope_parameters.rope_theta` is set (the released checkpoints have none: NoPE).
"""

from __future__ import annotations

from typing import Any

from workers.model.checkpoint.config import (
    ATTENTION,
    GDN,
    MLP,
    AttentionConfig,
    FeedForwardConfig,
    GdnConfig,
    HybridConfig,
)
from workers.model.checkpoint.config_fields import common_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import Source, single

OLMO_HYBRID_MODEL_TYPES = ("olmo_hybrid",)
GATED_NORM_EPS = 1e-5  # transformers' OlmoHybridGatedDeltaNet.o_norm (FLA's FusedRMSNormGated default)
DEFAULT_ROPE_THETA = 10000.0  # OlmoHybridConfig's when config.json names neither rope_parameters nor rope_theta


def layer_types(raw: dict[str, Any]) -> list[str]:
    """`layer_types`, or OlmoHybridConfig's default: full attention every 4th layer (the last if none would be)."""
    types = raw.get("layer_types")
    if types is None:
        num_layers = int(raw["num_hidden_layers"])
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise ValueError(f"unknown olmo_hybrid layer types {unknown}; expected 'linear_attention' or 'full_attention'")
    return list(types)


def rope_theta(raw: dict[str, Any]) -> float | None:
    """The RoPE base, or None for NoPE (`rope_parameters.rope_theta` or a top-level `rope_theta` set to null)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if params.get("rope_theta") is not None and rope_type != "default":
            raise ValueError(f"unsupported olmo_hybrid rope_type {rope_type!r}; supported: 'default' (or no RoPE)")
        theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    else:
        theta = raw.get("rope_theta", DEFAULT_ROPE_THETA)
    return None if theta is None else float(theta)


def _gdn_config(raw: dict[str, Any], num_heads: int) -> GdnConfig:
    """The linear-attention shapes, with OlmoHybridConfig's defaults for the fields a config.json may omit."""
    num_key_heads = int(raw.get("linear_num_key_heads") or num_heads)
    num_value_heads = int(raw.get("linear_num_value_heads") or num_heads)
    if num_value_heads % num_key_heads:
        raise ValueError(
            f"linear_num_value_heads={num_value_heads} must be a multiple of linear_num_key_heads={num_key_heads}"
        )
    key_head_dim = int(raw.get("linear_key_head_dim") or int(0.75 * int(raw["hidden_size"]) / num_key_heads))
    return GdnConfig(
        num_key_heads=num_key_heads,
        num_value_heads=num_value_heads,
        key_head_dim=key_head_dim,
        value_head_dim=int(raw.get("linear_value_head_dim") or 2 * key_head_dim),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        beta_scale=2.0 if raw.get("linear_allow_neg_eigval", True) else 1.0,
        norm_eps=GATED_NORM_EPS,
    )


def read_olmo_hybrid(raw: dict[str, Any]) -> dict[str, Any]:
    """HybridConfig fields (all but model_type) of an OLMo-Hybrid `config.json`."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported olmo_hybrid hidden_act {raw.get('hidden_act')!r}; supported: 'silu'")
    types = layer_types(raw)
    if "linear_attention" not in types or "full_attention" not in types:
        raise ValueError(f"olmo_hybrid needs both 'linear_attention' and 'full_attention' layers, got {types}")
    kinds, post_norm = [], []
    for layer, layer_type in enumerate(types):
        kinds += [GDN if layer_type == "linear_attention" else ATTENTION, MLP]
        if layer_type == "full_attention":
            post_norm += [2 * layer, 2 * layer + 1]
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw["hidden_size"]) // num_heads
    theta = rope_theta(raw)
    fields = common_fields(raw)
    fields["max_position_embeddings"] = int(raw.get("max_position_embeddings") or 65536)
    return {
        **fields,
        "block_kinds": tuple(kinds),
        "mamba": None,
        "gdn": _gdn_config(raw, num_heads),
        "attention": AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            bias=bool(raw.get("attention_bias", False)),
            rope_theta=theta,
            rotary_dim=head_dim,
            qk_norm=True,
            qk_norm_full_width=True,
        ),
        "feed_forward": FeedForwardConfig(intermediate_size=int(raw["intermediate_size"]), gated=True, bias=False),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "post_norm_blocks": tuple(post_norm),
    }


def _gdn_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    g, d = config.gdn, config.hidden_size
    projections = tuple(f"{hub}.{p}_proj.weight" for p in ("q", "k", "v", "g", "b", "a"))
    widths = (g.key_dim, g.key_dim, g.value_dim, g.value_dim, g.num_value_heads, g.num_value_heads)
    split_convs = tuple(f"{hub}.{p}_conv1d.weight" for p in ("q", "k", "v"))
    return {
        "in_proj.weight": [Source(projections, "cat", shapes=tuple((w, d) for w in widths))],
        "conv1d.weight": [
            Source((f"{hub}.conv1d.weight",)),
            Source(split_convs, "cat", cat_shape=(g.conv_dim, 1, g.conv_kernel)),
        ],
        "dt_bias": single(f"{hub}.dt_bias"),
        "A_log": single(f"{hub}.A_log"),
        "norm.weight": single(f"{hub}.o_norm.weight"),
        "out_proj.weight": single(f"{hub}.o_proj.weight"),
    }


def _attention_sources(hub: str) -> dict[str, list[Source]]:
    sources = {f"{p}_proj.{w}": single(f"{hub}.{p}_proj.{w}") for p in "qkvo" for w in ("weight", "bias")}
    sources.update({f"{n}.weight": single(f"{hub}.{n}.weight") for n in ("q_norm", "k_norm")})
    return sources


def olmo_hybrid_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name (but lm_head) → its candidate sources in an OLMo-Hybrid checkpoint."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.norm.weight"),
    }
    for block, kind in enumerate(config.block_kinds):
        hub, ours = f"model.layers.{block // 2}", f"blocks.{block}"
        if kind == GDN:  # pre-norm: the norms precede the mixer and the MLP
            sources[f"{ours}.norm.weight"] = single(
                f"{hub}.input_layernorm.weight", f"{hub}.attention_layer_norm.weight"
            )
        elif kind == ATTENTION:  # post-norm: after the attention, then after the MLP (block + 1)
            sources[f"{ours}.post_norm.weight"] = single(
                f"{hub}.post_attention_layernorm.weight", f"{hub}.feedforward_layer_norm.weight"
            )
            sources[f"blocks.{block + 1}.post_norm.weight"] = single(f"{hub}.post_feedforward_layernorm.weight")
        elif block not in config.post_norm_blocks:  # the MLP of a Gated DeltaNet layer
            sources[f"{ours}.norm.weight"] = single(
                f"{hub}.post_attention_layernorm.weight", f"{hub}.feedforward_layer_norm.weight"
            )
        if kind == GDN:
            mixer = _gdn_sources(config, f"{hub}.linear_attn")
        elif kind == ATTENTION:
            mixer = _attention_sources(f"{hub}.self_attn")
        else:
            mixer = {
                "up_proj.weight": [Source((f"{hub}.mlp.gate_proj.weight", f"{hub}.mlp.up_proj.weight"), "cat")],
                "down_proj.weight": single(f"{hub}.mlp.down_proj.weight"),
            }
        sources.update({f"{ours}.mixer.{name}": options for name, options in mixer.items()})
    return sources


register(Family(model_types=OLMO_HYBRID_MODEL_TYPES, read_config=read_olmo_hybrid, weight_sources=olmo_hybrid_sources))
