"""Falcon-H1 (TII): config reader and weight map.

A decoder layer is two blocks: a parallel mixer (Mamba2 and attention side by side on one normed input, their
outputs summed; `layers/parallel.py`), then a gated MLP. Weights live under `model.layers.N.{input_layernorm,
mamba.*, self_attn.*, pre_ff_layernorm, feed_forward.{gate,up,down}_proj}`.

Falcon-H1's μP multipliers are folded into the projection weights as they are read, so that the model runs the
plain Mamba2, attention and MLP modules (what transformers computes, `modeling_falcon_h1.py`):
- `ssm_in_multiplier` scales in_proj's input (its weight); `ssm_multipliers` [z, x, B, C, dt] scale in_proj's
  output rows (weight and bias: transformers' `mup_vector`); `ssm_out_multiplier` scales out_proj's output;
- `attention_in_multiplier` scales the q/k/v input (weights), `key_multiplier` the keys (k weight and bias),
  `attention_out_multiplier` o_proj's output;
- `mlp_multipliers` [gate, down] scale gate_proj's and down_proj's outputs;
- `embedding_multiplier` stays a runtime factor, `lm_head_multiplier` becomes the logits divisor (the LM head may be
  tied to the embeddings, so neither is folded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.model.checkpoint.config import (
    MLP,
    PARALLEL,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    MambaConfig,
)
from workers.model.checkpoint.config_fields import common_fields, dt_limits, rope_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import Source, single

SSM_PARTS = ("z", "x", "B", "C", "dt")  # in_proj's output parts, in order, each with one of `ssm_multipliers`
MULTIPLIER_DEFAULTS = {
    "embedding_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0,
    "key_multiplier": 1.0,
    "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0,
}


def _multipliers(raw: dict[str, Any]) -> dict[str, float]:
    """Every μP multiplier by name (`ssm_multipliers` as ssm_z … ssm_dt, `mlp_multipliers` as mlp_gate, mlp_down)."""
    found = {name: float(raw.get(name) if raw.get(name) is not None else d) for name, d in MULTIPLIER_DEFAULTS.items()}
    ssm = raw.get("ssm_multipliers") or [1.0] * len(SSM_PARTS)
    mlp = raw.get("mlp_multipliers") or [1.0, 1.0]
    if len(ssm) != len(SSM_PARTS) or len(mlp) != 2:
        raise ValueError(
            f"ssm_multipliers needs 5 values (z, x, B, C, dt), mlp_multipliers 2 (gate, down); got {ssm}, {mlp}"
        )
    found.update({f"ssm_{part}": float(v) for part, v in zip(SSM_PARTS, ssm)})
    found.update({"mlp_gate": float(mlp[0]), "mlp_down": float(mlp[1])})
    if found["lm_head_multiplier"] == 0.0:
        raise ValueError("lm_head_multiplier is 0: every logit would be 0")
    return found


def _mamba(raw: dict[str, Any]) -> MambaConfig:
    """Falcon-H1's Mamba2 fields: `mamba_d_ssm` (default mamba_expand × hidden) split into `mamba_n_heads` heads."""
    hidden, num_heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    d_ssm = raw.get("mamba_d_ssm")
    d_ssm = int(raw.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = d_ssm // num_heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * num_heads != d_ssm:
        raise ValueError(f"mamba_n_heads ({num_heads}) × mamba_d_head ({head_dim}) must equal mamba_d_ssm ({d_ssm})")
    dt_min, dt_max = dt_limits(raw)
    return MambaConfig(
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=int(raw.get("mamba_d_state", 256)),
        num_groups=int(raw.get("mamba_n_groups", 1)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=dt_min,
        dt_max=dt_max,
        out_proj_bias=bool(raw.get("projectors_bias", False)),
        rms_norm=bool(raw.get("mamba_rms_norm", False)),  # transformers' defaults when a config omits them
        norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)),
    )


def _attention(raw: dict[str, Any]) -> AttentionConfig:
    """Llama-style grouped-query attention with full RoPE; `head_dim` may differ from hidden / heads."""
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_scaling {scaling!r}; supported: none (default RoPE)")
    theta, rotary_dim = rope_fields(raw, head_dim, 1.0)
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        scale=head_dim**-0.5,
        bias=bool(raw.get("attention_bias", False)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
    )


def read_falcon_h1(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of a Falcon-H1 `config.json`."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} for falcon_h1; supported: 'silu'")
    multipliers = _multipliers(raw)
    return {
        **common_fields(raw),
        "block_kinds": (PARALLEL, MLP) * int(raw["num_hidden_layers"]),
        "mamba": _mamba(raw),
        "attention": _attention(raw),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw["intermediate_size"]), gated=True, bias=bool(raw.get("mlp_bias", False))
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
        "embedding_multiplier": multipliers["embedding_multiplier"],
        "logits_divisor": 1.0 / multipliers["lm_head_multiplier"],
        "weight_multipliers": tuple(sorted(multipliers.items())),
    }


def _scaled(key: str, shape: tuple[int, ...], scale: float | torch.Tensor) -> list[Source]:
    """One tensor times `scale` (a number, or a vector scaling the rows), in float32; its shape checked up front."""

    def transform(tensors: list[torch.Tensor]) -> torch.Tensor:
        factor = scale if isinstance(scale, float) else scale.reshape(-1, *([1] * (tensors[0].dim() - 1)))
        return tensors[0].float() * factor

    return [Source((key,), transform=transform, shapes=(shape,))]


def _gate_up(gate: str, up: str, shape: tuple[int, ...], gate_scale: float) -> list[Source]:
    """Our fused [gate; up] from the two tensors, the gate scaled by `mlp_multipliers[0]`."""
    transform: Callable[[list[torch.Tensor]], torch.Tensor] = lambda ts: torch.cat(  # noqa: E731
        [ts[0].float() * gate_scale, ts[1].float()]
    )
    return [Source((gate, up), transform=transform, shapes=(shape, shape))]


def _in_proj_row_scales(config: HybridConfig, multipliers: dict[str, float]) -> torch.Tensor:
    """transformers' `mup_vector`: one multiplier per in_proj output row, [z | x | B | C | dt]."""
    m = config.mamba
    sizes = [m.intermediate_size, m.intermediate_size, m.num_groups * m.state_size, m.num_groups * m.state_size]
    sizes.append(m.num_heads)
    return torch.cat([torch.full((n,), multipliers[f"ssm_{part}"]) for n, part in zip(sizes, SSM_PARTS)])


def falcon_h1_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Falcon-H1: `model.layers.N.*`, a parallel block and an MLP block per decoder layer, multipliers folded in."""
    mult = dict(config.weight_multipliers)
    m, a, d = config.mamba, config.attention, config.hidden_size
    rows = _in_proj_row_scales(config, mult)
    q_rows, kv_rows, ff = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, config.feed_forward.intermediate_size
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.final_layernorm.weight"),
    }
    for layer in range(len(config.block_kinds) // 2):
        hub, ours, mlp = f"model.layers.{layer}", f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}"
        mamba, attn = f"{ours}.mixer.mamba", f"{ours}.mixer.self_attn"
        sources[f"{ours}.norm.weight"] = single(f"{hub}.input_layernorm.weight")
        sources[f"{mlp}.norm.weight"] = single(f"{hub}.pre_ff_layernorm.weight")
        for name in ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
            sources[f"{mamba}.{name}"] = single(f"{hub}.mamba.{name}")
        in_rows = len(rows)
        sources[f"{mamba}.in_proj.weight"] = _scaled(
            f"{hub}.mamba.in_proj.weight", (in_rows, d), rows * mult["ssm_in_multiplier"]
        )
        sources[f"{mamba}.in_proj.bias"] = _scaled(f"{hub}.mamba.in_proj.bias", (in_rows,), rows)
        for name, shape in (("weight", (d, m.intermediate_size)), ("bias", (d,))):
            sources[f"{mamba}.out_proj.{name}"] = _scaled(
                f"{hub}.mamba.out_proj.{name}", shape, mult["ssm_out_multiplier"]
            )
        attn_in, key = mult["attention_in_multiplier"], mult["key_multiplier"]
        for proj, width, weight_scale, bias_scale in (
            ("q", q_rows, attn_in, 1.0),
            ("k", kv_rows, attn_in * key, key),
            ("v", kv_rows, attn_in, 1.0),
        ):
            sources[f"{attn}.{proj}_proj.weight"] = _scaled(
                f"{hub}.self_attn.{proj}_proj.weight", (width, d), weight_scale
            )
            sources[f"{attn}.{proj}_proj.bias"] = _scaled(f"{hub}.self_attn.{proj}_proj.bias", (width,), bias_scale)
        for name, shape in (("weight", (d, q_rows)), ("bias", (d,))):
            key_name = f"{hub}.self_attn.o_proj.{name}"
            sources[f"{attn}.o_proj.{name}"] = _scaled(key_name, shape, mult["attention_out_multiplier"])
        feed = f"{hub}.feed_forward"
        for name, shape in (("weight", (ff, d)), ("bias", (ff,))):
            gate, up = f"{feed}.gate_proj.{name}", f"{feed}.up_proj.{name}"
            sources[f"{mlp}.mixer.up_proj.{name}"] = _gate_up(gate, up, shape, mult["mlp_gate"])
        for name, shape in (("weight", (d, ff)), ("bias", (d,))):
            sources[f"{mlp}.mixer.down_proj.{name}"] = _scaled(f"{feed}.down_proj.{name}", shape, mult["mlp_down"])
    return sources


register(Family(model_types=("falcon_h1",), read_config=read_falcon_h1, weight_sources=falcon_h1_sources))
