"""Nemotron-H: config reader, weight map and MTP head keys.

One block per layer (`hybrid_override_pattern`: M Mamba2, * attention, - relu² MLP, E MoE with sigmoid routing over
expert groups), weights under `backbone.layers.N.{norm, mixer.*}` (hub) or `model.layers.N.*` (transformers 5). Its
multi-token-prediction head is blocks of its own (`mtp.layers.i`), in the order of the MTP pattern.
"""

from __future__ import annotations

from typing import Any

from workers.model.checkpoint.config import (
    ATTENTION,
    MAMBA,
    MLP,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    MambaConfig,
)
from workers.model.checkpoint.config_fields import common_fields, dt_limits, first_present, layer_kinds
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import ATTENTION_PARAMS, MAMBA_PARAMS, Source, single


def _nemotron_mtp_kinds(raw: dict[str, Any]) -> tuple[str, ...]:
    """The block kinds of Nemotron-H's MTP layer: the legacy `mtp_hybrid_override_pattern` string (hub configs,
    e.g. "*E"), else transformers 5's `mtp_layers_block_type` list, else transformers' default (attention, MoE)."""
    pattern = raw.get("mtp_hybrid_override_pattern")
    names = list(pattern) if isinstance(pattern, str) else raw.get("mtp_layers_block_type") or ["attention", "moe"]
    return tuple(layer_kinds(names))


def read_nemotron_h(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of a Nemotron-H `config.json`."""
    pattern = raw.get("hybrid_override_pattern")
    names = list(pattern) if isinstance(pattern, str) else raw.get("layers_block_type") or raw.get("layer_types")
    if not names:
        raise ValueError("nemotron_h config needs 'hybrid_override_pattern' or 'layers_block_type'")
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    _, dt_max = dt_limits(raw)
    dt_min = float(first_present(raw, "time_step_min", "mamba_dt_min", default=0.001))
    if raw.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"unsupported nemotron_h mlp_hidden_act {raw.get('mlp_hidden_act')!r}; supported: 'relu2'")
    return {
        **common_fields(raw),
        "block_kinds": tuple(layer_kinds(names)),
        "mamba": MambaConfig(
            num_heads=int(raw["mamba_num_heads"]),
            head_dim=int(raw["mamba_head_dim"]),
            state_size=int(raw.get("ssm_state_size", 128)),
            num_groups=int(first_present(raw, "n_groups", "mamba_n_groups", default=8)),
            conv_kernel=int(first_present(raw, "conv_kernel", "mamba_d_conv", default=4)),
            chunk_size=int(first_present(raw, "chunk_size", "mamba_chunk_size", default=128)),
            conv_bias=bool(first_present(raw, "use_conv_bias", "mamba_conv_bias", default=True)),
            proj_bias=bool(raw.get("use_bias", False)),
            dt_min=dt_min,  # Nemotron-H clamps softplus(dt) from below at time_step_min
            dt_max=dt_max,
        ),
        "attention": AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            bias=bool(raw.get("attention_bias", False)),
            rope_theta=None,
            rotary_dim=0,
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw.get("intermediate_size", 0)),
            gated=False,
            bias=bool(raw.get("mlp_bias", False)),
            num_experts=int(first_present(raw, "n_routed_experts", "num_local_experts", default=0)),
            experts_per_token=int(raw.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            router="sigmoid",
            num_expert_groups=int(raw.get("n_group") or 1),
            topk_groups=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size") or 0),
            latent_size=raw.get("moe_latent_size"),
        ),
        "rms_norm_eps": float(first_present(raw, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
        "mtp_block_kinds": _nemotron_mtp_kinds(raw),
        "mtp_num_layers": int(raw.get("num_nextn_predict_layers") or 1),
    }


def _nemotron_block_sources(kind: str, hub: str, ours: str, num_experts: int) -> dict[str, list[Source]]:
    """One Nemotron-H block `hub.{norm, mixer.*}` (a backbone layer or an MTP block) → our `ours.{norm, mixer.*}`."""
    sources = {f"{ours}.norm.weight": single(f"{hub}.norm.weight")}
    names = {MAMBA: MAMBA_PARAMS, ATTENTION: ATTENTION_PARAMS}.get(kind, ())
    if kind == MLP:
        names = ("up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias")
    for name in names:
        sources[f"{ours}.mixer.{name}"] = single(f"{hub}.mixer.{name}")
    if kind in (MAMBA, ATTENTION, MLP):
        return sources
    mix = f"{hub}.mixer"
    sources[f"{ours}.mixer.router.weight"] = single(f"{mix}.gate.weight")
    sources[f"{ours}.mixer.router.e_score_correction_bias"] = single(f"{mix}.gate.e_score_correction_bias")
    for ours_name, hub_name in (("experts_up", "up_proj"), ("experts_down", "down_proj")):
        per_expert = tuple(f"{mix}.experts.{e}.{hub_name}.weight" for e in range(num_experts))
        sources[f"{ours}.mixer.{ours_name}"] = [Source(per_expert, "stack"), Source((f"{mix}.experts.{hub_name}",))]
    for name in ("up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias"):
        sources[f"{ours}.mixer.shared.{name}"] = single(f"{mix}.shared_experts.{name}")
    for ours_name, hub_name in (("latent_in", "fc1_latent_proj"), ("latent_out", "fc2_latent_proj")):
        for w in ("weight", "bias"):
            sources[f"{ours}.mixer.{ours_name}.{w}"] = single(f"{mix}.{hub_name}.{w}")
    return sources


def _nemotron_sources(config: HybridConfig, prefix: str) -> dict[str, list[Source]]:
    """Nemotron-H: `backbone.layers.N.{norm, mixer.*}`, one block per layer; and the MTP head (`mtp.layers.i`, one
    block each, in the order of the MTP pattern; the first also holds `enorm`, `hnorm`, `eh_proj`, the last
    `final_layernorm`), read only when the model was built with it."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single(f"{prefix}.embeddings.weight"),
        "final_norm.weight": single(f"{prefix}.norm_f.weight"),
    }
    num_experts = config.feed_forward.num_experts
    for block, kind in enumerate(config.block_kinds):
        sources.update(_nemotron_block_sources(kind, f"{prefix}.layers.{block}", f"blocks.{block}", num_experts))
    for block, kind in enumerate(config.mtp_block_kinds):
        sources.update(_nemotron_block_sources(kind, f"mtp.layers.{block}", f"mtp.blocks.{block}", num_experts))
    last = len(config.mtp_block_kinds) - 1
    for ours, hub in (
        ("fc", "0.eh_proj"),
        ("pre_fc_norm_embedding", "0.enorm"),
        ("pre_fc_norm_hidden", "0.hnorm"),
        ("norm", f"{last}.final_layernorm"),
    ):
        sources[f"mtp.{ours}.weight"] = single(f"mtp.layers.{hub}.weight")
    return sources


def nemotron_h_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name (but lm_head) → its candidate sources: under `backbone.*` (hub) or `model.*`
    (transformers 5)."""
    prefix = "model" if any(k.startswith("model.") for k in checkpoint_keys) else "backbone"
    return _nemotron_sources(config, prefix)


def nemotron_h_mtp_head_keys(config: HybridConfig) -> list[str]:
    """The checkpoint keys that frame Nemotron-H's MTP head: the first layer's `enorm`, `hnorm`, `eh_proj`, every
    block's norm, the last block's `final_layernorm`."""
    num_blocks = len(config.mtp_block_kinds)
    keys = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight"]
    keys += [f"mtp.layers.{block}.norm.weight" for block in range(num_blocks)]
    return keys + [f"mtp.layers.{num_blocks - 1}.final_layernorm.weight"]


register(
    Family(
        model_types=("nemotron_h",),
        read_config=read_nemotron_h,
        weight_sources=nemotron_h_sources,
        mtp_head_keys=nemotron_h_mtp_head_keys,
    )
)
