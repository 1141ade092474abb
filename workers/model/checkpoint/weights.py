"""Where each of our parameters lives in a hub checkpoint, per family.

`checkpoint_sources` maps every parameter name of `HybridModel` to a `Source`: the checkpoint key(s) it is read
from and how they combine (a single tensor, gate/up concatenated, or per-expert matrices stacked). A parameter
may list alternatives (transformers 5 and the hub spell some keys differently); the first whose keys are all
present wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.model.checkpoint.config import ATTENTION, DENSE_MODEL_TYPES, MAMBA, MLP, QWEN_MODEL_TYPES, HybridConfig

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
    transform: Callable[[list[torch.Tensor]], torch.Tensor] | None = None  # replaces `combine` when set
    shapes: tuple[tuple[int, ...], ...] | None = None  # each key's expected shape, checked before reading


def _one(*alternatives: str) -> list[Source]:
    return [Source((key,)) for key in alternatives]


def _ibm_sources(config: HybridConfig) -> dict[str, list[Source]]:
    """Granite 4.0-H and Bamba: `model.layers.N.*`, two blocks per decoder layer."""
    bamba = config.model_type == "bamba"
    sources: dict[str, list[Source]] = {"embed_tokens.weight": _one("model.embed_tokens.weight")}
    sources["final_norm.weight"] = _one("model.final_layernorm.weight" if bamba else "model.norm.weight")
    for block, kind in enumerate(config.block_kinds):
        layer, ours_prefix = block // 2, f"blocks.{block}"
        hub = f"model.layers.{layer}"
        if kind in (MAMBA, ATTENTION):
            sources[f"{ours_prefix}.norm.weight"] = _one(f"{hub}.input_layernorm.weight")
            names, sub = (MAMBA_PARAMS, "mamba") if kind == MAMBA else (ATTENTION_PARAMS, "self_attn")
            for name in names:
                sources[f"{ours_prefix}.mixer.{name}"] = _one(f"{hub}.{sub}.{name}")
            continue
        sources[f"{ours_prefix}.norm.weight"] = _one(
            f"{hub}.{'pre_ff_layernorm' if bamba else 'post_attention_layernorm'}.weight"
        )
        mlp = f"{ours_prefix}.mixer" if kind == MLP else f"{ours_prefix}.mixer.shared"
        if bamba:
            ff = f"{hub}.feed_forward"
            sources[f"{mlp}.up_proj.weight"] = [Source((f"{ff}.gate_proj.weight", f"{ff}.up_proj.weight"), "cat")]
            sources[f"{mlp}.up_proj.bias"] = [Source((f"{ff}.gate_proj.bias", f"{ff}.up_proj.bias"), "cat")]
            sources[f"{mlp}.down_proj.weight"] = _one(f"{ff}.down_proj.weight")
            sources[f"{mlp}.down_proj.bias"] = _one(f"{ff}.down_proj.bias")
        else:
            sources[f"{mlp}.up_proj.weight"] = _one(f"{hub}.shared_mlp.input_linear.weight")
            sources[f"{mlp}.down_proj.weight"] = _one(f"{hub}.shared_mlp.output_linear.weight")
        moe = f"{hub}.block_sparse_moe"
        sources[f"{ours_prefix}.mixer.router.weight"] = _one(f"{moe}.router.layer.weight")
        sources[f"{ours_prefix}.mixer.experts_up"] = _one(f"{moe}.input_linear.weight", f"{moe}.experts.gate_up_proj")
        sources[f"{ours_prefix}.mixer.experts_down"] = _one(f"{moe}.output_linear.weight", f"{moe}.experts.down_proj")
    return sources


def _nemotron_block_sources(kind: str, hub: str, ours: str, num_experts: int) -> dict[str, list[Source]]:
    """One Nemotron-H block `hub.{norm, mixer.*}` (a backbone layer or an MTP block) → our `ours.{norm, mixer.*}`."""
    sources = {f"{ours}.norm.weight": _one(f"{hub}.norm.weight")}
    names = {MAMBA: MAMBA_PARAMS, ATTENTION: ATTENTION_PARAMS}.get(kind, ())
    if kind == MLP:
        names = ("up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias")
    for name in names:
        sources[f"{ours}.mixer.{name}"] = _one(f"{hub}.mixer.{name}")
    if kind in (MAMBA, ATTENTION, MLP):
        return sources
    mix = f"{hub}.mixer"
    sources[f"{ours}.mixer.router.weight"] = _one(f"{mix}.gate.weight")
    sources[f"{ours}.mixer.router.e_score_correction_bias"] = _one(f"{mix}.gate.e_score_correction_bias")
    for ours_name, hub_name in (("experts_up", "up_proj"), ("experts_down", "down_proj")):
        per_expert = tuple(f"{mix}.experts.{e}.{hub_name}.weight" for e in range(num_experts))
        sources[f"{ours}.mixer.{ours_name}"] = [Source(per_expert, "stack"), Source((f"{mix}.experts.{hub_name}",))]
    for name in ("up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias"):
        sources[f"{ours}.mixer.shared.{name}"] = _one(f"{mix}.shared_experts.{name}")
    for ours_name, hub_name in (("latent_in", "fc1_latent_proj"), ("latent_out", "fc2_latent_proj")):
        for w in ("weight", "bias"):
            sources[f"{ours}.mixer.{ours_name}.{w}"] = _one(f"{mix}.{hub_name}.{w}")
    return sources


def _nemotron_sources(config: HybridConfig, prefix: str) -> dict[str, list[Source]]:
    """Nemotron-H: `backbone.layers.N.{norm, mixer.*}`, one block per layer; and the MTP head (`mtp.layers.i`, one
    block each, in the order of the MTP pattern; the first also holds `enorm`, `hnorm`, `eh_proj`, the last
    `final_layernorm`), read only when the model was built with it."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": _one(f"{prefix}.embeddings.weight"),
        "final_norm.weight": _one(f"{prefix}.norm_f.weight"),
    }
    num_experts = config.feed_forward.num_experts
    for block, kind in enumerate(config.block_kinds):
        sources.update(_nemotron_block_sources(kind, f"{prefix}.layers.{block}", f"blocks.{block}", num_experts))
    for block, kind in enumerate(config.mtp_block_kinds):
        sources.update(_nemotron_block_sources(kind, f"mtp.layers.{block}", f"mtp.blocks.{block}", num_experts))
    last = len(config.mtp_block_kinds) - 1
    for ours, hub in (("fc", "0.eh_proj"), ("pre_fc_norm_embedding", "0.enorm"), ("pre_fc_norm_hidden", "0.hnorm"),
                      ("norm", f"{last}.final_layernorm")):  # fmt: skip
        sources[f"mtp.{ours}.weight"] = _one(f"mtp.layers.{hub}.weight")
    return sources


def _dense_sources(config: HybridConfig) -> dict[str, list[Source]]:
    """Llama-style attention-only models: `model.layers.N.{input_layernorm, self_attn, post_attention_layernorm,
    mlp}`, two blocks per decoder layer (attention, then the MLP with gate and up fused)."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": _one("model.embed_tokens.weight"),
        "final_norm.weight": _one("model.norm.weight"),
    }
    for layer in range(len(config.block_kinds) // 2):
        hub, attention, mlp = f"model.layers.{layer}", f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}"
        sources[f"{attention}.norm.weight"] = _one(f"{hub}.input_layernorm.weight")
        for name in (*ATTENTION_PARAMS, "q_norm.weight", "k_norm.weight"):
            sources[f"{attention}.mixer.{name}"] = _one(f"{hub}.self_attn.{name}")
        sources[f"{mlp}.norm.weight"] = _one(f"{hub}.post_attention_layernorm.weight")
        for w in ("weight", "bias"):
            sources[f"{mlp}.mixer.up_proj.{w}"] = [
                Source((f"{hub}.mlp.gate_proj.{w}", f"{hub}.mlp.up_proj.{w}"), "cat")
            ]
            sources[f"{mlp}.mixer.down_proj.{w}"] = _one(f"{hub}.mlp.down_proj.{w}")
    return sources


def checkpoint_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name → its candidate sources in a checkpoint with `checkpoint_keys`."""
    if config.model_type in QWEN_MODEL_TYPES:
        from workers.model.checkpoint.weights_qwen import qwen_sources  # it builds on this module's Source

        sources = qwen_sources(config, checkpoint_keys)
    elif config.model_type in DENSE_MODEL_TYPES:
        sources = _dense_sources(config)
    elif config.model_type == "nemotron_h":
        prefix = "model" if any(k.startswith("model.") for k in checkpoint_keys) else "backbone"
        sources = _nemotron_sources(config, prefix)
    else:
        sources = _ibm_sources(config)
    sources["lm_head.weight"] = _one("lm_head.weight")
    return sources


def mtp_head_keys(config: HybridConfig) -> list[str]:
    """The checkpoint keys that frame an MTP head of `config`'s family (its projections and norms; the mixers'
    weights are matched at load like every other parameter's)."""
    if config.model_type in QWEN_MODEL_TYPES:
        layer = "mtp.layers.0"
        return ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight", "mtp.norm.weight"]  # fmt: skip
    num_blocks = len(config.mtp_block_kinds)
    keys = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight"]
    keys += [f"mtp.layers.{block}.norm.weight" for block in range(num_blocks)]
    return keys + [f"mtp.layers.{num_blocks - 1}.final_layernorm.weight"]


def is_ignored(key: str) -> bool:
    """Checkpoint keys that are present in real checkpoints but not part of the model we run."""
    return key.startswith(IGNORED_PREFIXES) or key.endswith(IGNORED_SUFFIXES)
