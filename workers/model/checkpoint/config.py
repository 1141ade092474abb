"""One normalised architecture description for every supported hybrid family.

`config.json` files of Granite 4.0-H, Bamba, Nemotron-H, the Qwen Gated DeltaNet hybrids and attention-only models
name the same ideas differently (and the hub's names differ from transformers 5's). `HybridConfig.from_hf_dict`
reads any of them into one frozen dataclass, so the model code never looks at a family-specific field name; each
family's reader lives in `families/` and is found through `registry.py`.

A model is a flat list of *blocks*, each `x = x + residual_multiplier * mixer(norm(x))`. A Granite/Bamba decoder
layer is two blocks (sequence mixer, then feed-forward); a Nemotron-H layer is one block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.model.checkpoint import registry

# Block kinds. Recurrent blocks (Mamba2, Gated DeltaNet) hold a per-request state; a model has one recurrent kind.
MAMBA, GDN, ATTENTION, MLP, MOE = "mamba", "gdn", "attention", "mlp", "moe"
MAMBA1 = "mamba1"  # Mamba version 1 (Jamba): selective scan with per-channel A [d_inner, n]
SHORT_CONV = "short_conv"  # LFM2's gated short convolution: its recurrent state is the conv window alone
KDA = "kda"  # Kimi Delta Attention (Kimi-Linear): the delta rule with a per-channel decay
# Falcon-H1's layer: Mamba2 and attention side by side on one normed input, outputs summed; it holds a Mamba2 state
# (so it counts as recurrent) and a KV cache.
PARALLEL = "parallel"
RECURRENT_KINDS = (MAMBA, GDN, MAMBA1, SHORT_CONV, KDA, PARALLEL)
ATTENTION_KINDS = (ATTENTION, PARALLEL)  # the blocks that hold a KV cache of their own (Zamba2's uses: see below)
# Zamba2: one use of a shared transformer block (own KV cache, adapters, output projection); see layers/shared_block.py.
SHARED_ATTENTION = "shared_attention"


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
    norm_eps: float | None = None  # the gated norm's epsilon when it is not rms_norm_eps (Zamba2: 1e-5)
    out_proj_bias: bool | None = None  # when it differs from proj_bias (Falcon-H1's projectors_bias)
    rms_norm: bool = True  # False: y · silu(z) without a norm (Falcon-H1's mamba_rms_norm)
    norm_before_gate: bool = False  # rmsnorm(y) · silu(z) instead of rmsnorm(y · silu(z))
    # Tensor parallel with fewer B/C groups than ranks: one gated-norm group spans this many ranks (each holds a
    # slice of its channels), so the norm's mean square is all-reduced. 1: every norm group lies on one rank.
    norm_span: int = 1

    @property
    def fused_kernels_fit(self) -> bool:
        """Whether the native and Triton Mamba2 kernels compute this mixer (they fuse rmsnorm(y · silu(z)) over
        norm groups that lie on one rank, so not a norm spanning tensor-parallel ranks)."""
        return self.rms_norm and not self.norm_before_gate and self.norm_span == 1

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
    beta_scale: float = 1.0  # beta = beta_scale · sigmoid(b); OLMo-Hybrid's 2 allows negative eigenvalues
    norm_eps: float | None = None  # the gated output norm's eps when it differs from rms_norm_eps (OLMo-Hybrid: 1e-5)

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
class Mamba1Config:
    """Shapes of the Mamba (version 1) mixers of Jamba: one selective-scan state [d_inner, n] per layer."""

    intermediate_size: int  # d_inner = mamba_expand × hidden size: width of x, of the gate z and of the conv
    state_size: int  # n
    conv_kernel: int  # W
    dt_rank: int  # r: x_proj's dt rows, which dt_proj widens back to d_inner
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj (x_proj has no bias; dt_proj always has one)
    chunk_size: int = 64  # positions whose per-position states the prefill scan holds at once (at most)


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution: in_proj → B, C, x; C · causal_conv(B · x) over `conv_kernel` taps; out_proj."""

    conv_kernel: int  # W (`conv_L_cache`)
    bias: bool  # in_proj, conv and out_proj biases (`conv_bias`)
    channels: int | None = None  # width of B, C, x and the conv (None: the hidden size; a rank's share under TP)


@dataclass(frozen=True)
class KdaConfig:
    """Shapes of the Kimi Delta Attention mixers (Kimi-Linear): q, k and v share the head count and head dim."""

    num_heads: int  # h
    head_dim: int  # d: key and value head dim alike
    conv_kernel: int  # W
    chunk_size: int = 64  # the chunked delta rule's block length (prefill)

    @property
    def qkv_dim(self) -> int:
        """Width of each of q, k and v: heads × head dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convs: q, k and v together."""
        return 3 * self.qkv_dim


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention shapes (DeepSeek-V2 style, as Kimi-Linear uses it without RoPE)."""

    num_heads: int
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj → RMSNorm → q_b_proj
    kv_lora_rank: int  # width of the cached latent
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the shared key part stored beside the latent (unrotated in Kimi-Linear)
    v_head_dim: int
    bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj biases

    @property
    def qk_head_dim(self) -> int:
        """Width of each query / key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    head_gate: bool = False  # output × sigmoid(g_proj(x)), one gate per head (LFM3)
    sliding_window: int | None = None  # each query sees the keys of its last `sliding_window` positions (LFM3)
    # Proportional RoPE (LFM3 full attention): pairs (i, i + head_dim / 2) rotate for i < rope_pairs only, at the
    # frequencies theta^(-2i / head_dim) of the whole head (rotary_dim is then head_dim). None: plain RoPE.
    rope_pairs: int | None = None
    qk_norm_full_width: bool = False  # with qk_norm: one RMSNorm over the whole q (k) projection, not per head (OLMo)
    # Width of each cached value head when it differs from head_dim: latent attention caches one "key" head
    # [latent | rope key] (head_dim wide) and no value (0).
    cache_value_dim: int | None = None
    # Tensor parallel with fewer KV heads than ranks: each rank's one KV head is held by this many ranks (T / kv).
    # 1: the KV heads are split, kv / T per rank. The layer reads it to name the KV head its rank holds.
    kv_replicas: int = 1

    @property
    def cache_widths(self) -> tuple[int, int]:
        """(key, value) widths of one cached KV head."""
        return self.head_dim, self.head_dim if self.cache_value_dim is None else self.cache_value_dim


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
    topk_norm_eps: float = 1e-20  # sigmoid routing: top-k weights / (their sum + this) (LFM2-MoE: 1e-6)


@dataclass(frozen=True)
class SharedBlockConfig:
    """Zamba2's shared transformer blocks: `num_blocks` weight sets used round-robin at the hybrid layers, each use
    on [hidden, original embeddings] (2d wide) with its own KV cache, low-rank adapters and output projection."""

    num_blocks: int
    intermediate_size: int  # the shared gated-GELU MLP's
    bias: bool  # the MLP's linears (add_bias_linear)
    adapter_rank: int
    attention_adapters: bool  # per-use low-rank adapters on q, k, v (use_shared_attention_adapter)
    mlp_adapters: bool  # per-use low-rank adapters on the MLP's gate/up projection (use_shared_mlp_adapter)


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
    shared_block: SharedBlockConfig | None = None  # Zamba2's shared transformer blocks (SHARED_ATTENTION uses)
    short_conv: ShortConvConfig | None = None  # LFM2 short-conv families only
    sandwich_norms: bool = False  # every block also norms its mixer's output before the residual add (LFM3)
    # Per block: the attention config of that block where it differs from `attention` (LFM3's sliding-window and
    # full layers differ in RoPE and window); empty, or None at a block, means `attention`.
    block_attention: tuple[AttentionConfig | None, ...] = ()
    # Blocks whose norm follows the mixer, `x + norm(mixer(x))`, instead of preceding it (OLMo 2/3 attention layers).
    post_norm_blocks: tuple[int, ...] = ()
    mamba1: Mamba1Config | None = None  # Mamba version 1 families (Jamba) only
    kda: KdaConfig | None = None  # Kimi Delta Attention families only
    mla: MlaConfig | None = None  # latent attention families only: attention blocks are `MultiHeadLatentAttention`
    # Multipliers the family's weight map folds into the weights it reads, by name (Falcon-H1's μP multipliers).
    weight_multipliers: tuple[tuple[str, float], ...] = ()

    def attention_of(self, block: int) -> AttentionConfig:
        """The attention config of block `block` (`attention` unless `block_attention` overrides it)."""
        override = self.block_attention[block] if block < len(self.block_attention) else None
        return override if override is not None else self.attention

    @property
    def recurrent_kind(self) -> str | None:
        """MAMBA or GDN: the kind of this model's recurrent blocks (None when it has none)."""
        kinds = {kind for kind in self.block_kinds if kind in RECURRENT_KINDS}
        assert len(kinds) <= 1, "a model mixes Mamba2 and Gated DeltaNet blocks"
        return kinds.pop() if kinds else None

    def recurrent_state_shapes(self) -> tuple[tuple[int, int], tuple[int, ...]]:
        """Per request and recurrent layer: (conv window [c, W-1], float32 state) — Mamba2 [h, p, n],
        Gated DeltaNet [h_v, d_k, d_v], Kimi Delta Attention [h, d, d], Mamba1 [d_inner, n] or none for the short
        conv ((0, 0, 0)). A model without recurrent blocks gets empty shapes."""
        if self.mamba1 is not None:
            m1 = self.mamba1
            return (m1.intermediate_size, m1.conv_kernel - 1), (m1.intermediate_size, m1.state_size)
        if self.short_conv is not None:  # the conv window of B · x only: no matrix state
            channels = self.short_conv.channels or self.hidden_size
            return (channels, self.short_conv.conv_kernel - 1), (0, 0, 0)
        if self.kda is not None:
            k = self.kda
            return (k.conv_dim, k.conv_kernel - 1), (k.num_heads, k.head_dim, k.head_dim)
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
        family = registry.family_of(model_type)
        if family is None:
            raise ValueError(
                f"unsupported model_type {model_type!r} (architectures={raw.get('architectures')}); "
                f"supported model types: {', '.join(registry.model_types())}"
            )
        return cls(model_type=model_type, **family.read_config(raw))
