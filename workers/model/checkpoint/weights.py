"""Where each of our parameters lives in a hub checkpoint.

`checkpoint_sources` maps every parameter name of `HybridModel` to a `Source`: the checkpoint key(s) it is read
from and how they combine (a single tensor, gate/up concatenated, or per-expert matrices stacked). A parameter
may list alternatives (transformers 5 and the hub spell some keys differently); the first whose keys are all
present wins. Each family's map lives in `families/`, found through `registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.model.checkpoint import registry
from workers.model.checkpoint.config import HybridConfig

# Checkpoint keys we knowingly do not use (multi-token-prediction heads, vision towers, cached RoPE tables).
IGNORED_PREFIXES = ("mtp.", "model.visual.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

MAMBA_PARAMS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                "norm.weight", "out_proj.weight", "out_proj.bias")  # fmt: skip
ATTENTION_PARAMS = tuple(f"{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias"))


@dataclass(frozen=True)
class Source:
    """How one parameter is assembled from checkpoint tensors."""

    keys: tuple[str, ...]
    combine: str = "one"  # "one" | "cat" (along dim 0) | "stack" (new dim 0)
    group: int = 1  # "stack": keys per stacked item, concatenated along dim 0 (2: an expert's gate and up)
    transform: Callable[[list[torch.Tensor]], torch.Tensor] | None = None  # replaces `combine` when set
    shapes: tuple[tuple[int, ...], ...] | None = None  # each key's expected shape, checked before reading
    cat_shape: tuple[int, ...] | None = None  # the keys' shape once concatenated along dim 0, checked before reading


def stacked_pairs(keys: tuple[str, ...], shapes: tuple[tuple[int, ...], ...] | None = None) -> Source:
    """Per-expert matrices `(gate_0, up_0, gate_1, up_1, …)` → `[E, gate rows + up rows, in]`: each expert's pair
    concatenated, the experts stacked (a tensor-parallel rank reads one expert's share at a time)."""
    return Source(keys, "stack", group=2, shapes=shapes)


def single(*alternatives: str) -> list[Source]:
    """A parameter read from one tensor, stored under any of these keys (the first present wins)."""
    return [Source((key,)) for key in alternatives]


def checkpoint_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name → its candidate sources in a checkpoint with `checkpoint_keys`."""
    family = registry.family_of(config.model_type)
    assert family is not None, f"no family reads {config.model_type!r} (HybridConfig.from_hf_dict checks)"
    sources = family.weight_sources(config, checkpoint_keys)
    sources["lm_head.weight"] = single("lm_head.weight")
    return sources


def mtp_head_keys(config: HybridConfig) -> list[str]:
    """The checkpoint keys that frame an MTP head of `config`'s family (its projections and norms; the mixers'
    weights are matched at load like every other parameter's)."""
    family = registry.family_of(config.model_type)
    assert family is not None and family.mtp_head_keys is not None, f"{config.model_type!r} serves no MTP head"
    return family.mtp_head_keys(config)


def is_ignored(key: str) -> bool:
    """Checkpoint keys that are present in real checkpoints but not part of the model we run."""
    return key.startswith(IGNORED_PREFIXES) or key.endswith(IGNORED_SUFFIXES)
