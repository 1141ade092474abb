"""One normalised architecture description for every supported hybrid family.

`config.json` files of Granite 4.0-H, Bamba, Nemotron-H and the Qwen Gated DeltaNet hybrids name the same ideas
differently (and the hub's names
differ from transformers 5's). `HybridConfig.from_hf_dict` reads any of them into one frozen dataclass, so the
model code never looks at a family-specific field name.

A model is a flat list of *blocks*, each `x = x + residual_multiplier * mixer(norm(x))`. A Granite/Bamba decoder
layer is two blocks (sequence mixer, then feed-forward); a Nemotron-H layer is one block. The Qwen readers
(Qwen3-Next, Qwen3.5, Qwen3.5-MoE) live in `config_qwen.py`, the attention-only families (Llama, Mistral, Qwen2,
Qwen3, Granite) in `config_dense.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

QWEN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")  # attention-only (drafts, mostly)
SUPPORTED_MODEL_TYPES = ("granitemoehybrid", "bamba", "nemotron_h", *QWEN_MODEL_TYPES, *DENSE_MODEL_TYPES)
MTP_MODEL_TYPES = (*QWEN_MODEL_TYPES, "nemotron_h")  # families whose multi-token-prediction heads are served

# Block kinds. Recurrent blocks (Mamba2, Gated DeltaNet) hold a per-request state; a model has one recurrent kind.
MAMBA, GDN, ATTENTION, MLP, MOE = "mamba", "gdn", "attention", "mlp", "moe"
RECURRENT_KINDS = (MAMBA, GDN)

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


@dataclass(frozen=True)
class MambaConfig:
    """Shapes and limits of the Mamba2 mixers of a model."""

    num_heads: int  # h
    head_dim: int  # p
    state_size: int  # n
    num_groups: int  # g
    conv_kernel: int  # W
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float  # softplus(dt) is clamped to [dt_min, dt_max]
    dt_max: float

    @property
    def intermediate_size(self) -> int:
        """Width of x (and of the gate z): heads × head dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C together."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size


@dataclass(frozen=True)
class GdnConfig:
    """Shapes of the Gated DeltaNet mixers (Qwen3-Next, Qwen3.5): value heads share key heads in groups."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: value head j reads key head j // (value / key heads)
    key_head_dim: int  # d_k
    value_head_dim: int  # d_v
    conv_kernel: int  # W
    chunk_size: int = 64  # the chunked delta rule's block length (prefill)

    @property
    def key_dim(self) -> int:
        """Width of q (and of k): key heads × key head dim."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of the gate z): value heads × value head dim."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention shapes and positional encoding."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    bias: bool  # q, k, v projections (and o_proj unless output_bias says otherwise)
    rope_theta: float | None  # None: no positional encoding (NoPE)
    rotary_dim: int  # leading dims of each head that RoPE rotates (partial RoPE)
    output_gate: bool = False  # q_proj rows per head are [q_h | gate_h]; output × sigmoid(gate) (Qwen)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen)
    output_bias: bool | None = None  # o_proj bias when it differs from `bias` (Qwen2: q/k/v only)


@dataclass(frozen=True)
class FeedForwardConfig:
    """Dense MLP and mixture-of-experts shapes."""

    intermediate_size: int  # dense MLP (Granite: the shared MLP)
    gated: bool  # silu(gate) * up (Granite, Bamba) or relu(up)^2 (Nemotron-H)
    bias: bool
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # the MoE block's always-on shared MLP
    router: str = "softmax"  # "softmax" (Granite) or "sigmoid" (Nemotron-H, grouped, with score bias)
    num_expert_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None  # Nemotron-H MoE latent projection
    shared_expert_gate: bool = False  # shared MLP output × sigmoid(linear(x)) (Qwen)


@dataclass(frozen=True)
class HybridConfig:
    """Everything the model code needs, in one vocabulary for all families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    block_kinds: tuple[str, ...]
    mamba: MambaConfig | None  # None for families without Mamba2 blocks
    attention: AttentionConfig
    feed_forward: FeedForwardConfig
    rms_norm_eps: float
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    gdn: GdnConfig | None = None  # Gated DeltaNet families only
    zero_centred_norms: bool = False  # checkpoint RMSNorm weights w scale by (1 + w) (Qwen); the loader adds 1
    mtp_block_kinds: tuple[str, ...] = ()  # the blocks of one MTP layer (used only when its head is loaded)
    mtp_num_layers: int = 1  # MTP layers the config declares (0 or unset read as 1: the weights tell if there is one)

    @property
    def recurrent_kind(self) -> str | None:
        """MAMBA or GDN: the kind of this model's recurrent blocks (None when it has none)."""
        kinds = {kind for kind in self.block_kinds if kind in RECURRENT_KINDS}
        assert len(kinds) <= 1, "a model mixes Mamba2 and Gated DeltaNet blocks"
        return kinds.pop() if kinds else None

    def recurrent_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per request and recurrent layer: (conv window [c, W-1], float32 state) — Mamba2 [h, p, n] or
        Gated DeltaNet [h_v, d_k, d_v]. A model without recurrent blocks gets empty shapes."""
        if self.gdn is not None:
            g = self.gdn
            return (g.conv_dim, g.conv_kernel - 1), (g.num_value_heads, g.key_head_dim, g.value_head_dim)
        if self.mamba is None:
            return (0, 0), (0, 0, 0)
        m = self.mamba
        return (m.conv_dim, m.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> HybridConfig:
        """Build from the parsed `config.json` of a supported family; `ValueError` for anything else."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} (architectures={raw.get('architectures')}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in QWEN_MODEL_TYPES:
            from workers.model.checkpoint.config_qwen import read_qwen  # it builds on this module's dataclasses

            return cls(model_type=model_type, **read_qwen(raw))
        if model_type in DENSE_MODEL_TYPES:
            from workers.model.checkpoint.config_dense import read_dense  # it builds on this module's dataclasses

            return cls(model_type=model_type, **read_dense(raw))
        reader = {"granitemoehybrid": _granite, "bamba": _bamba, "nemotron_h": _nemotron_h}[model_type]
        return cls(model_type=model_type, **common_fields(raw), **reader(raw))


def _float(value: Any) -> float:
    """Float from a config value; transformers 5 saves infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _dt_limits(raw: dict[str, Any], default_min: float = 0.0) -> tuple[float, float]:
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


def _kinds(names: list[str]) -> list[str]:
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


def _mamba_ibm(raw: dict[str, Any]) -> MambaConfig:
    """Mamba fields as Granite 4.0-H and Bamba name them."""
    num_heads = int(raw["mamba_n_heads"])
    head_dim = raw.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = int(raw.get("mamba_expand", 2)) * int(raw["hidden_size"]) // num_heads
    dt_min, dt_max = _dt_limits(raw)
    return MambaConfig(
        num_heads=num_heads,
        head_dim=int(head_dim),
        state_size=int(raw.get("mamba_d_state", 256)),
        num_groups=int(raw.get("mamba_n_groups", 1)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=dt_min,
        dt_max=dt_max,
    )


def _attention_ibm(raw: dict[str, Any], scale: float | None, rope: bool, partial: float) -> AttentionConfig:
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    theta, rotary_dim = rope_fields(raw, head_dim, partial) if rope else (None, 0)
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        scale=head_dim**-0.5 if scale is None else float(scale),
        bias=bool(raw.get("attention_bias", False)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
    )


def _granite(raw: dict[str, Any]) -> dict[str, Any]:
    layer_types = raw.get("layer_types") or raw.get("layers_block_type")
    if layer_types is None:
        layer_types = ["mamba"] * int(raw["num_hidden_layers"])
    kinds = []
    for kind in _kinds(layer_types):
        kinds += [kind, MLP]  # sequence mixer, then the (shared MLP + MoE) feed-forward block
    num_experts = int(raw.get("num_local_experts") or 0)
    if num_experts:
        kinds = [MOE if k == MLP else k for k in kinds]
    return {
        "block_kinds": tuple(kinds),
        "mamba": _mamba_ibm(raw),
        "attention": _attention_ibm(
            raw, raw.get("attention_multiplier", 1.0), raw.get("position_embedding_type") == "rope", 1.0
        ),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
            gated=True,
            bias=False,
            num_experts=num_experts,
            experts_per_token=int(raw.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(raw.get("intermediate_size", 0)),
            shared_expert_intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
            router="softmax",
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "logits_divisor": float(raw.get("logits_scaling", 1.0)),
    }


def _bamba(raw: dict[str, Any]) -> dict[str, Any]:
    attention_layers = set(raw.get("attn_layer_indices") or [])
    kinds = []
    for i in range(int(raw["num_hidden_layers"])):
        kinds += [ATTENTION if i in attention_layers else MAMBA, MLP]
    return {
        "block_kinds": tuple(kinds),
        "mamba": _mamba_ibm(raw),
        "attention": _attention_ibm(raw, None, True, 0.5),
        "feed_forward": FeedForwardConfig(
            intermediate_size=int(raw["intermediate_size"]), gated=True, bias=bool(raw.get("mlp_bias", False))
        ),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
    }


def _get(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    """First present key among the hub's and transformers 5's names for one field."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return default


def _nemotron_mtp_kinds(raw: dict[str, Any]) -> tuple[str, ...]:
    """The block kinds of Nemotron-H's MTP layer: the legacy `mtp_hybrid_override_pattern` string (hub configs,
    e.g. "*E"), else transformers 5's `mtp_layers_block_type` list, else transformers' default (attention, MoE)."""
    pattern = raw.get("mtp_hybrid_override_pattern")
    names = list(pattern) if isinstance(pattern, str) else raw.get("mtp_layers_block_type") or ["attention", "moe"]
    return tuple(_kinds(names))


def _nemotron_h(raw: dict[str, Any]) -> dict[str, Any]:
    pattern = raw.get("hybrid_override_pattern")
    names = list(pattern) if isinstance(pattern, str) else raw.get("layers_block_type") or raw.get("layer_types")
    if not names:
        raise ValueError("nemotron_h config needs 'hybrid_override_pattern' or 'layers_block_type'")
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    _, dt_max = _dt_limits(raw)
    dt_min = float(_get(raw, "time_step_min", "mamba_dt_min", default=0.001))
    if raw.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"unsupported nemotron_h mlp_hidden_act {raw.get('mlp_hidden_act')!r}; supported: 'relu2'")
    return {
        "block_kinds": tuple(_kinds(names)),
        "mamba": MambaConfig(
            num_heads=int(raw["mamba_num_heads"]),
            head_dim=int(raw["mamba_head_dim"]),
            state_size=int(raw.get("ssm_state_size", 128)),
            num_groups=int(_get(raw, "n_groups", "mamba_n_groups", default=8)),
            conv_kernel=int(_get(raw, "conv_kernel", "mamba_d_conv", default=4)),
            chunk_size=int(_get(raw, "chunk_size", "mamba_chunk_size", default=128)),
            conv_bias=bool(_get(raw, "use_conv_bias", "mamba_conv_bias", default=True)),
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
            num_experts=int(_get(raw, "n_routed_experts", "num_local_experts", default=0)),
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
        "rms_norm_eps": float(_get(raw, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
        "mtp_block_kinds": _nemotron_mtp_kinds(raw),
        "mtp_num_layers": int(raw.get("num_nextn_predict_layers") or 1),
    }
