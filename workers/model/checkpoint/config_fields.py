"""Readers of the `config.json` fields several families name alike, for the family readers in `families/`."""

from __future__ import annotations

import math
from typing import Any

from workers.model.checkpoint.config import ATTENTION, MAMBA, MLP, MOE

_LAYER_TYPE_ALIASES = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "m": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "*": ATTENTION,
    "mlp": MLP,
    "-": MLP,
    "moe": MOE,
    "e": MOE,
}


def _float(value: Any) -> float:
    """Float from a config value; transformers 5 saves infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def dt_limits(raw: dict[str, Any], default_min: float = 0.0) -> tuple[float, float]:
    """(min, max) of the Mamba2 time step, from `time_step_limit` or `mamba_dt_limit` (default [0, ∞))."""
    limit = raw.get("time_step_limit") or raw.get("mamba_dt_limit") or (0.0, math.inf)
    return max(_float(limit[0]), default_min), _float(limit[1])


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields every family names alike: vocabulary, width, tying, limits, special tokens, dtype."""
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(raw.get("max_position_embeddings") or 4096),
        "eos_token_ids": eos_ids,
        "bos_token_id": raw.get("bos_token_id"),
        "torch_dtype": raw.get("dtype") or raw.get("torch_dtype"),
    }


def layer_kinds(names: list[str]) -> list[str]:
    """Block kinds of a list of layer-type names ("mamba", "attention", "moe", …, or pattern letters "M*-E")."""
    kinds = []
    for name in names:
        kind = _LAYER_TYPE_ALIASES.get(str(name).lower())
        if kind is None:
            raise ValueError(f"unknown layer type {name!r}; expected one of {sorted(_LAYER_TYPE_ALIASES)}")
        kinds.append(kind)
    return kinds


def rope_fields(raw: dict[str, Any], head_dim: int, partial_factor: float) -> tuple[float, int]:
    """(theta, rotary dims) of a plain RoPE; `partial_factor` unless `rope_parameters` names its own."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", partial_factor))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default'")
    return theta, int(head_dim * factor)


def first_present(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    """First present key among the hub's and transformers 5's names for one field."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return default
