"""Kimi-Linear (Moonshot's Kimi-Linear-48B-A3B): config reader and weight map.

A decoder layer is two blocks: Kimi Delta Attention (KDA) or multi-head latent attention (MLA, without RoPE), then
a dense SwiGLU MLP (the first `first_k_dense_replace` layers) or a MoE with shared experts and grouped sigmoid
routing with a score-correction bias (the Nemotron-H / DeepSeek-V3 router).

The hub's `config.json` names the layer layout in `linear_attn_config` (`kda_layers` / `full_attn_layers`,
1-based) and the MoE as `num_experts`, `num_experts_per_token`, `num_expert_group`, `num_shared_experts`,
`moe_renormalize`, `moe_router_activation_func`, `moe_layer_freq`; transformers 5 also writes `layer_types` and
`mlp_layer_types`, which win when present (transformers' own precedence). Weights are the hub's
`model.layers.N.self_attn.*` and `model.layers.N.{mlp, block_sparse_moe}.*` (what transformers' save_pretrained
writes too); the names of transformers' in-memory modules (`forget_gate.*`, one stacked `conv1d`, fused experts
under `mlp.`) are accepted as well. Conversions done here, once, at load:
- KDA: `q, k, v, f_a, g_a, b` projections → one `in_proj` (rows in that order); `q_conv1d, k_conv1d, v_conv1d`
  → one `conv1d`; `A_log` [1, 1, h, 1] → [h].
- MLA: `kv_b_proj` [h · (nope + v), L] → `kv_b` [h, nope + v, L].
- Experts: per-expert `w1` (gate), `w3` (up), `w2` (down) stacked into `experts_up [E, 2I, H]`, `experts_down`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from workers.model.checkpoint.config import (
    ATTENTION,
    KDA,
    MLP,
    MOE,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    KdaConfig,
    MlaConfig,
)
from workers.model.checkpoint.config_fields import common_fields, first_present
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import Source, single, stacked_pairs

# Features of later Kimi models (Kimi-K3) that this reader does not implement: refused by name, not ignored.
_UNSUPPORTED_LINEAR = {"gate_lower_bound": None, "use_full_rank_gate": False}
_UNSUPPORTED_TOP = {"mla_use_output_gate": False, "attn_res_block_size": None, "latent_moe_use_norm": None}


def _refuse_unsupported(raw: dict[str, Any], linear: dict[str, Any]) -> None:
    for where, fields in ((linear, _UNSUPPORTED_LINEAR), (raw, _UNSUPPORTED_TOP)):
        for name, default in fields.items():
            if where.get(name, default) not in (default, None):
                raise ValueError(f"kimi_linear {name}={where[name]!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported kimi_linear hidden_act {raw.get('hidden_act')!r}; supported: 'silu'")
    if not raw.get("mla_use_nope", True):
        raise ValueError("kimi_linear mla_use_nope=false (RoPE in latent attention) is not supported")
    activation = raw.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(f"unsupported kimi_linear moe_router_activation_func {activation!r}; supported: 'sigmoid'")


def _mixer_kinds(raw: dict[str, Any], linear: dict[str, Any], num_layers: int) -> list[str]:
    """KDA or ATTENTION per layer: `layer_types`, else `linear_attn_config`'s 1-based lists, else transformers'
    default (full attention at every 4th layer but the first)."""
    names = raw.get("layer_types")
    if names is None and "kda_layers" in linear and "full_attn_layers" in linear:
        full, kda = set(linear["full_attn_layers"]), set(linear["kda_layers"])
        if full & kda or full | kda != set(range(1, num_layers + 1)):
            raise ValueError(
                f"kimi_linear linear_attn_config: kda_layers and full_attn_layers must split layers 1 … {num_layers}"
            )
        names = ["full_attention" if layer + 1 in full else "linear_attention" for layer in range(num_layers)]
    if names is None:
        names = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    kinds = {"linear_attention": KDA, "full_attention": ATTENTION}
    unknown = sorted({str(n) for n in names if n not in kinds})
    if unknown or len(names) != num_layers:
        raise ValueError(f"kimi_linear layer_types must be {num_layers} of 'linear_attention' / 'full_attention'")
    return [kinds[n] for n in names]


def _ff_kinds(raw: dict[str, Any], num_layers: int, num_experts: int) -> list[str]:
    """MLP or MOE per layer: `mlp_layer_types` ("dense" / "sparse"), else the hub's rule (experts from layer
    `first_k_dense_replace` on, every `moe_layer_freq`-th layer)."""
    names = raw.get("mlp_layer_types")
    if names is not None:
        if len(names) != num_layers or set(names) - {"dense", "sparse"}:
            raise ValueError(f"kimi_linear mlp_layer_types must be {num_layers} of 'dense' / 'sparse'")
        return [MOE if name == "sparse" else MLP for name in names]
    first_dense = int(raw.get("first_k_dense_replace", 1))
    frequency = int(raw.get("moe_layer_freq") or 1)
    return [MOE if num_experts and i >= first_dense and i % frequency == 0 else MLP for i in range(num_layers)]


def _mla_config(raw: dict[str, Any]) -> MlaConfig:
    """The multi-head latent attention of a Kimi-Linear `config.json`."""
    q_lora = raw.get("q_lora_rank")
    return MlaConfig(
        num_heads=int(raw["num_attention_heads"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        bias=bool(raw.get("attention_bias", False)),
    )


def read_kimi_linear(raw: dict[str, Any]) -> dict[str, Any]:
    """HybridConfig fields (all but model_type) of a Kimi-Linear `config.json`."""
    linear = raw.get("linear_attn_config") or {}
    _refuse_unsupported(raw, linear)
    num_layers = int(raw["num_hidden_layers"])
    num_experts = int(first_present(raw, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    kinds = []
    for mixer, ff in zip(_mixer_kinds(raw, linear, num_layers), _ff_kinds(raw, num_layers, num_experts)):
        kinds += [mixer, ff]
    num_shared = int(first_present(raw, "num_shared_experts", "n_shared_experts", default=0))
    if MOE in kinds and num_shared < 1:
        raise ValueError("kimi_linear MoE layers without shared experts (num_shared_experts 0) are not supported")
    groups = int(first_present(raw, "num_expert_group", "n_group", default=1))
    if num_experts % groups:
        raise ValueError(f"kimi_linear num_experts={num_experts} must be a multiple of num_expert_group={groups}")
    mla = _mla_config(raw)
    moe_size = int(raw.get("moe_intermediate_size") or 0)
    fields = common_fields(raw)
    fields["max_position_embeddings"] = int(first_present(raw, "model_max_length", "max_position_embeddings") or 4096)
    return {
        **fields,
        "block_kinds": tuple(kinds),
        "mamba": None,
        "kda": KdaConfig(
            num_heads=int(first_present(linear, "num_heads", default=raw.get("linear_num_heads", 32))),
            head_dim=int(first_present(linear, "head_dim", default=raw.get("linear_head_dim", 128))),
            conv_kernel=int(
                first_present(linear, "short_conv_kernel_size", default=raw.get("linear_conv_kernel_dim", 4))
            ),
        ),
        "mla": mla,
        # The cache of an attention block: one head [latent | rope key], no value (see layers/mla.py).
        "attention": AttentionConfig(
            num_heads=mla.num_heads,
            num_kv_heads=1,
            head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
            scale=mla.qk_head_dim**-0.5,
            bias=mla.bias,
            rope_theta=None,
            rotary_dim=0,
            cache_value_dim=0,
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw.get("intermediate_size") or 0),
            gated=True,
            bias=False,
            num_experts=num_experts,
            experts_per_token=int(first_present(raw, "num_experts_per_token", "num_experts_per_tok", default=0)),
            expert_intermediate_size=moe_size,
            shared_expert_intermediate_size=moe_size * num_shared,
            router="sigmoid",
            num_expert_groups=groups,
            topk_groups=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(first_present(raw, "moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
    }


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].reshape(-1)


def _per_head(num_heads: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].reshape(num_heads, -1, tensors[0].shape[-1])


def _kda_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    k, d = config.kda, config.hidden_size
    width, kernel = k.qkv_dim, k.conv_kernel
    gate = (f"{hub}.f_a_proj", f"{hub}.f_b_proj", f"{hub}.dt_bias", f"{hub}.A_log")  # hub names
    moved = tuple(name.replace(f"{hub}.", f"{hub}.forget_gate.") for name in gate)  # transformers' module names
    in_keys = [f"{hub}.{p}_proj.weight" for p in "qkv"] + [f"{gate[0]}.weight", f"{hub}.g_a_proj.weight"]
    in_shapes = ((width, d),) * 3 + ((k.head_dim, d),) * 2 + ((k.num_heads, d),)
    sources = {
        "in_proj.weight": [
            Source((*in_keys, f"{hub}.b_proj.weight"), transform=_cat, shapes=in_shapes),
            Source((*in_keys[:3], f"{moved[0]}.weight", in_keys[4], f"{hub}.b_proj.weight"), transform=_cat,
                   shapes=in_shapes),
        ],
        "conv1d.weight": [
            Source(tuple(f"{hub}.{p}_conv1d.weight" for p in "qkv"), transform=_cat, shapes=((width, 1, kernel),) * 3),
            Source((f"{hub}.conv1d.weight",)),
        ],
        "A_log": [Source((name,), transform=_flat, shapes=((1, 1, k.num_heads, 1),)) for name in (gate[3], moved[3])],
        "dt_bias": single(gate[2], moved[2]),
        "f_b_proj.weight": single(f"{gate[1]}.weight", f"{moved[1]}.weight"),
    }  # fmt: skip
    for name in ("g_b_proj.weight", "o_norm.weight", "o_proj.weight"):
        sources[name] = single(f"{hub}.{name}")
    return sources


def _mla_sources(config: HybridConfig, hub: str) -> dict[str, list[Source]]:
    m = config.mla
    shape = (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    sources = {
        "kv_b": [Source((f"{hub}.kv_b_proj.weight",), transform=partial(_per_head, m.num_heads), shapes=(shape,))]
    }
    for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj"):
        for w in ("weight", "bias"):
            sources[f"{name}.{w}"] = single(f"{hub}.{name}.{w}")
    return sources


def _ff_sources(config: HybridConfig, layer: str, kind: str) -> dict[str, list[Source]]:
    """A dense MLP (`mlp.{gate,up,down}_proj`) or the MoE (`block_sparse_moe.*`, or transformers' `mlp.*`)."""
    ff, d = config.feed_forward, config.hidden_size
    if kind == MLP:  # transformers' save_pretrained writes dense MLPs under `block_sparse_moe.` too
        hubs = (f"{layer}.mlp", f"{layer}.block_sparse_moe")
        shapes = ((ff.intermediate_size, d),) * 2
        return {
            "up_proj.weight": [
                Source((f"{h}.gate_proj.weight", f"{h}.up_proj.weight"), "cat", shapes=shapes) for h in hubs
            ],
            "down_proj.weight": single(*(f"{h}.down_proj.weight" for h in hubs)),
        }
    num_experts, size, shared = ff.num_experts, ff.expert_intermediate_size, ff.shared_expert_intermediate_size
    sources: dict[str, list[Source]] = {}
    for hub in (f"{layer}.block_sparse_moe", f"{layer}.mlp"):
        per_gate_up = tuple(f"{hub}.experts.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w3"))
        per_down = tuple(f"{hub}.experts.{e}.w2.weight" for e in range(num_experts))
        shared_gate_up = tuple(f"{hub}.shared_experts.{p}_proj.weight" for p in ("gate", "up"))
        options = {
            "router.weight": [Source((f"{hub}.gate.weight",))],
            "router.e_score_correction_bias": [Source((f"{hub}.gate.e_score_correction_bias",))],
            "experts_up": [stacked_pairs(per_gate_up, shapes=((size, d),) * 2 * num_experts),
                           Source((f"{hub}.experts.gate_up_proj",))],
            "experts_down": [Source(per_down, "stack", shapes=((d, size),) * num_experts),
                             Source((f"{hub}.experts.down_proj",))],
            "shared.up_proj.weight": [Source(shared_gate_up, "cat", shapes=((shared, d),) * 2)],
            "shared.down_proj.weight": [Source((f"{hub}.shared_experts.down_proj.weight",))],
        }  # fmt: skip
        for name, found in options.items():
            sources.setdefault(name, []).extend(found)
    return sources


def kimi_linear_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name (but lm_head) → its candidate sources in a Kimi-Linear checkpoint."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.norm.weight"),
    }
    for block, kind in enumerate(config.block_kinds):
        layer, ours = f"model.layers.{block // 2}", f"blocks.{block}"
        norm = "input_layernorm" if kind in (KDA, ATTENTION) else "post_attention_layernorm"
        sources[f"{ours}.norm.weight"] = single(f"{layer}.{norm}.weight")
        if kind == KDA:
            mixer = _kda_sources(config, f"{layer}.self_attn")
        elif kind == ATTENTION:
            mixer = _mla_sources(config, f"{layer}.self_attn")
        else:
            mixer = _ff_sources(config, layer, kind)
        sources.update({f"{ours}.mixer.{name}": options for name, options in mixer.items()})
    return sources


register(Family(model_types=("kimi_linear",), read_config=read_kimi_linear, weight_sources=kimi_linear_sources))
