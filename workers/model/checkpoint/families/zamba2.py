"""Zamba2 (Zyphra): config reader and weight map.

A Mamba2 backbone; at each hybrid layer (`layers_block_type` "hybrid", or `hybrid_layer_ids`) a use of one of
`num_mem_blocks` shared transformer blocks (round-robin) runs first, on [hidden, original embeddings]
(`layers/shared_block.py`). A plain layer is one block (Mamba2), a hybrid layer two (the use, then Mamba2).

Hub keys: `model.layers.N.mamba.*` + `input_layernorm` (plain layers); `model.layers.N.mamba_decoder.{mamba.*,
input_layernorm}`, `model.layers.N.linear`, and `model.layers.N.shared_transformer.*` (hybrid layers). The shared
block's weights, and all its uses' adapters (`…adapter_list.U.{0,1}.weight`, U the use's index among all uses), are
stored under the block's first hybrid layer — and in some checkpoints copied under every layer that uses it: the
copies must be equal, and are all read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workers.model.checkpoint.config import (
    MAMBA,
    SHARED_ATTENTION,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    MambaConfig,
    SharedBlockConfig,
)
from workers.model.checkpoint.config_fields import common_fields, first_present, rope_fields
from workers.model.checkpoint.registry import Family, register
from workers.model.checkpoint.weights import MAMBA_PARAMS, Source, single

_MAMBA_NAMES = ("mamba", "m", "linear_attention")
_HYBRID_NAMES = ("hybrid", "g")


def _layer_is_hybrid(raw: dict[str, Any]) -> list[bool]:
    """Per layer: whether it is a hybrid layer, from `layers_block_type` (hub "mamba"/"hybrid", transformers 5
    "linear_attention"/"hybrid") or from `hybrid_layer_ids` with `num_hidden_layers`."""
    names = raw.get("layers_block_type") or raw.get("layer_types")
    ids = raw.get("hybrid_layer_ids")
    if names is None:
        if ids is None or raw.get("num_hidden_layers") is None:
            raise ValueError("zamba2 config needs 'layers_block_type' or 'hybrid_layer_ids' with 'num_hidden_layers'")
        return [i in set(ids) for i in range(int(raw["num_hidden_layers"]))]
    unknown = sorted({str(n) for n in names if str(n).lower() not in _MAMBA_NAMES + _HYBRID_NAMES})
    if unknown:
        raise ValueError(f"unknown zamba2 layer types {unknown}; expected one of {_MAMBA_NAMES + _HYBRID_NAMES}")
    hybrid = [str(n).lower() in _HYBRID_NAMES for n in names]
    if ids is not None and [i for i, h in enumerate(hybrid) if h] != list(ids):
        raise ValueError(f"zamba2 config: hybrid_layer_ids {ids} disagree with layers_block_type")
    return hybrid


def _mamba(raw: dict[str, Any]) -> MambaConfig:
    """Zamba2's Mamba2 mixers: head dim = expand · hidden / heads; the conv always has a bias (transformers builds
    one whatever `use_conv_bias` says); softplus(dt) ≥ time_step_min (transformers clamps there on prompts)."""
    num_heads, hidden = int(raw.get("n_mamba_heads", 8)), int(raw["hidden_size"])
    head_dim = int(raw.get("mamba_expand", 2) * hidden) // num_heads
    if raw.get("mamba_headdim") is not None and int(raw["mamba_headdim"]) != head_dim:
        raise ValueError(f"zamba2 config: mamba_headdim {raw['mamba_headdim']} != mamba_expand · hidden / heads")
    return MambaConfig(
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=int(raw.get("mamba_d_state", 64)),
        num_groups=int(raw.get("mamba_ngroups", 1)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("chunk_size", 256)),
        conv_bias=True,
        proj_bias=bool(raw.get("add_bias_linear", False)),
        dt_min=float(raw.get("time_step_min", 0.001)),
        dt_max=math.inf,
        norm_eps=1e-5,  # transformers' Zamba2 gated norm has a fixed epsilon
    )


def _attention(raw: dict[str, Any]) -> AttentionConfig:
    """The shared blocks' attention: input 2d, head dim 2d / heads, scores scaled by (head_dim / 2)^-0.5."""
    num_heads = int(raw.get("num_attention_heads", 32))
    head_dim = 2 * int(raw["hidden_size"]) // num_heads
    rope = bool(raw.get("use_mem_rope", False))
    if rope and raw.get("use_long_context"):
        raise ValueError(
            "zamba2 use_long_context with use_mem_rope is not supported: Zyphra's code rescales the RoPE base "
            "(× 8^(d/(d-2))) and transformers 5 does not, so there is no one reference to match"
        )
    theta, rotary_dim = rope_fields(raw, head_dim, 1.0) if rope else (None, 0)
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        scale=(head_dim / 2) ** -0.5,
        bias=False,
        rope_theta=theta,
        rotary_dim=rotary_dim,
    )


def read_zamba2(raw: dict[str, Any]) -> dict[str, Any]:
    """`HybridConfig` fields (beyond model_type) of a Zamba2 `config.json`."""
    hidden = int(raw["hidden_size"])
    if str(raw.get("hidden_act", "gelu")) != "gelu":
        raise ValueError(f"unsupported zamba2 hidden_act {raw.get('hidden_act')!r}; supported: 'gelu'")
    kinds: list[str] = []
    for hybrid in _layer_is_hybrid(raw):
        kinds += [SHARED_ATTENTION, MAMBA] if hybrid else [MAMBA]
    intermediate = int(first_present(raw, "intermediate_size", "ffn_hidden_size", default=4 * hidden))
    bias = bool(raw.get("add_bias_linear", False))
    return {
        **common_fields(raw),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),  # Zamba2Config's default
        "block_kinds": tuple(kinds),
        "mamba": _mamba(raw),
        "attention": _attention(raw),
        "feed_forward": FeedForwardConfig(intermediate_size=intermediate, gated=True, bias=bias),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
        "shared_block": SharedBlockConfig(
            num_blocks=int(raw.get("num_mem_blocks", 1)),
            intermediate_size=intermediate,
            bias=bias,
            adapter_rank=int(raw.get("adapter_rank", 128)),
            attention_adapters=bool(raw.get("use_shared_attention_adapter", False)),
            mlp_adapters=bool(raw.get("use_shared_mlp_adapter", True)),
        ),
    }


def _identical(keys: tuple[str, ...]):
    """A transform reading copies of one tensor (the same shared weight under several layers): the first, after
    checking that every copy equals it."""

    def first(tensors: list[torch.Tensor]) -> torch.Tensor:
        for key, tensor in zip(keys[1:], tensors[1:]):
            if not torch.equal(tensor, tensors[0]):
                raise ValueError(f"checkpoint copies of a shared zamba2 weight differ: {keys[0]!r} and {key!r}")
        return tensors[0]

    return first


def _shared_source(names: list[str], shape: tuple[int, ...], checkpoint_keys: set[str]) -> list[Source]:
    """Every copy of a shared tensor present in the checkpoint (`names`: its key under each layer of its block,
    the first layer first), read as one; when none is present, the first layer's key (named as missing)."""
    present = tuple(name for name in names if name in checkpoint_keys)
    if len(present) <= 1:
        return single(present[0] if present else names[0])
    return [Source(present, transform=_identical(present), shapes=(shape,) * len(present))]


def _shared_shapes(config: HybridConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our name inside a use → (the hub name under `shared_transformer.`, shape) of each shared-block tensor."""
    s, a, d = config.shared_block, config.attention, config.hidden_size
    q, kv, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, s.intermediate_size
    shapes = {
        "input_norm.weight": ("input_layernorm.weight", (2 * d,)),
        "pre_ff_norm.weight": ("pre_ff_layernorm.weight", (d,)),
        "attention.q_proj.base.weight": ("self_attn.q_proj.weight", (q, 2 * d)),
        "attention.k_proj.base.weight": ("self_attn.k_proj.weight", (kv, 2 * d)),
        "attention.v_proj.base.weight": ("self_attn.v_proj.weight", (kv, 2 * d)),
        "attention.o_proj.weight": ("self_attn.o_proj.weight", (d, q)),
        "gate_up_proj.base.weight": ("feed_forward.gate_up_proj.weight", (2 * i, d)),
        "down_proj.weight": ("feed_forward.down_proj.weight", (d, i)),
    }
    if s.bias:
        shapes["gate_up_proj.base.bias"] = ("feed_forward.gate_up_proj.bias", (2 * i,))
        shapes["down_proj.bias"] = ("feed_forward.down_proj.bias", (d,))
    return shapes


def _adapter_shapes(config: HybridConfig, use: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our name inside a use → (hub name under `shared_transformer.`, shape) of use `use`'s adapters."""
    s, a, d = config.shared_block, config.attention, config.hidden_size
    widths = {"q": a.num_heads * a.head_dim, "k": a.num_kv_heads * a.head_dim, "v": a.num_kv_heads * a.head_dim}
    shapes = {}
    if s.attention_adapters:
        for p, width in widths.items():
            hub = f"self_attn.linear_{p}_adapter_list.{use}"
            shapes[f"attention.{p}_proj.adapter.down.weight"] = (f"{hub}.0.weight", (s.adapter_rank, 2 * d))
            shapes[f"attention.{p}_proj.adapter.up.weight"] = (f"{hub}.1.weight", (width, s.adapter_rank))
    if s.mlp_adapters:
        hub = f"feed_forward.gate_up_proj_adapter_list.{use}"
        shapes["gate_up_proj.adapter.down.weight"] = (f"{hub}.0.weight", (s.adapter_rank, d))
        shapes["gate_up_proj.adapter.up.weight"] = (f"{hub}.1.weight", (2 * s.intermediate_size, s.adapter_rank))
    return shapes


def zamba2_sources(config: HybridConfig, checkpoint_keys: set[str]) -> dict[str, list[Source]]:
    """Every parameter name (but lm_head) → its candidate sources."""
    sources: dict[str, list[Source]] = {
        "embed_tokens.weight": single("model.embed_tokens.weight"),
        "final_norm.weight": single("model.final_layernorm.weight"),
    }
    # Layer index of each block, and the hybrid layers in use order.
    layer_of, layer, uses = [], 0, []
    for kind in config.block_kinds:
        layer_of.append(layer)
        if kind == SHARED_ATTENTION:
            uses.append(layer)
        else:
            layer += 1
    num_blocks = config.shared_block.num_blocks
    use = 0
    for block, kind in enumerate(config.block_kinds):
        ours, hub = f"blocks.{block}", f"model.layers.{layer_of[block]}"
        if kind == MAMBA:
            inner = f"{hub}.mamba_decoder" if layer_of[block] in uses else hub
            sources[f"{ours}.norm.weight"] = single(f"{inner}.input_layernorm.weight")
            for name in MAMBA_PARAMS:
                sources[f"{ours}.mixer.{name}"] = single(f"{inner}.mamba.{name}")
            continue
        sources[f"{ours}.mixer.linear.weight"] = single(f"{hub}.linear.weight")
        # The layers holding this use's shared block (its first use first): where its weights may be stored.
        holders = uses[use % num_blocks :: num_blocks]
        tensors = {**_shared_shapes(config), **_adapter_shapes(config, use)}
        for name, (hub_name, shape) in tensors.items():
            names = [f"model.layers.{h}.shared_transformer.{hub_name}" for h in holders]
            sources[f"{ours}.mixer.{name}"] = _shared_source(names, shape, checkpoint_keys)
        use += 1
    return sources


register(Family(model_types=("zamba2",), read_config=read_zamba2, weight_sources=zamba2_sources))
