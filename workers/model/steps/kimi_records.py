"""The records of Kimi-Linear's mixers in a decode plan: Kimi Delta Attention and multi-head latent attention, as
the native module path computes them (`KimiDeltaAttentionMixer._native_decode`, `MultiHeadLatentAttention.
_native_forward`), so that plan and module agree bit for bit.

KDA: in_proj → copies of its f_a and g_a parts → f_b_proj, g_b_proj (linears of their own) → one KDA record (convs,
gates, delta rule, gated norm; `csrc/kda_decode.c`) → o_proj. A verification keeps in_proj's output and f per layer
(the shift re-runs the accepted tokens from them, as Gated DeltaNet's does from in_proj's output alone).
MLA: q_proj (or q_a_proj → q_a_layernorm → q_b_proj) and kv_a_proj_with_mqa → one MLA record (latent norm, cache
write, absorbed attention; `csrc/mla_attention.c`) → o_proj.
"""

from __future__ import annotations

import torch

from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.native_linear import NativeLinear
from workers.model.steps.plan_records import Op, Recorder, scratch_rows


def kda_kept_width(mixer: KimiDeltaAttentionMixer) -> int:
    """Floats per token a verification keeps for a KDA layer's shift: in_proj's output and f."""
    return mixer.in_proj.out_features + mixer.config.qkv_dim


def kimi_unsupported_reason(mixer: torch.nn.Module) -> str | None:
    """Why a KDA or latent attention mixer cannot be recorded, or None when it can."""
    linears = [m for m in mixer.modules() if isinstance(m, torch.nn.Linear | NativeLinear)]
    if not all(isinstance(m, NativeLinear) for m in linears):
        return "a Kimi-Linear mixer has linears outside the native kernel"
    if isinstance(mixer, KimiDeltaAttentionMixer) and mixer.decode_kernel != "native":
        return "Kimi Delta Attention decode steps do not run through the native kernel"
    if isinstance(mixer, MultiHeadLatentAttention):
        norms = [getattr(mixer, "q_a_layernorm", None), mixer.kv_a_layernorm]
        if not mixer.native or not all(norm.native for norm in norms if norm is not None):
            return "latent attention decode steps do not run through the native kernel"
    return None


class KimiScratch:
    """Buffers of up to `tokens` rows for the KDA and latent attention records of `model`'s blocks."""

    def __init__(self, model: torch.nn.Module, tokens: int):
        mixers = [block.mixer for block in model.blocks]
        kdas = [m.config for m in mixers if isinstance(m, KimiDeltaAttentionMixer)]
        mlas = [m.config for m in mixers if isinstance(m, MultiHeadLatentAttention)]
        self.low = torch.empty(tokens * max([k.head_dim for k in kdas], default=0))  # f_a, then g_a
        self.f, self.gate = (torch.empty(tokens * max([k.qkv_dim for k in kdas], default=0)) for _ in "fg")
        self.q_low = torch.empty(tokens * max([m.q_lora_rank or 0 for m in mlas], default=0))
        self.kv = torch.empty(tokens * max([m.kv_lora_rank + m.qk_rope_head_dim for m in mlas], default=0))


def _kda_inputs(
    plan: object, mixer: KimiDeltaAttentionMixer, layer: int, n: int, length: int
) -> tuple[torch.Tensor, ...]:
    """Where a KDA layer's in_proj output [n, width] and f [n, h·d] go: kept per layer through a verification (the
    shift re-runs tokens from them), else scratch."""
    width, qkv_dim = mixer.in_proj.out_features, mixer.config.qkv_dim
    if length > 1:
        kept = plan.kept_proj[layer]
        return kept[: n * width].view(n, width), kept[n * width : n * (width + qkv_dim)].view(n, qkv_dim)
    return scratch_rows(plan.wide, n, width), scratch_rows(plan.kimi_scratch.f, n, qkv_dim)


def _kda_state_arguments(plan: object, mixer: KimiDeltaAttentionMixer, layer: int) -> list[torch.Tensor]:
    """The KDA records' arguments from the conv windows to the delta-rule states (the conv weight [3·h·d, 1, W] is
    the [3·h·d, W] the module path squeezes)."""
    return [plan.pool.conv[layer], mixer.conv1d.weight, mixer.dt_bias, mixer.A_log, plan.pool.ssm[layer]]


def record_kda(rec: Recorder, plan: object, mixer: KimiDeltaAttentionMixer, layer: int) -> None:
    """A KDA block's records, reading `plan.normed` and writing `plan.mixed`, for rec.rows · rec.length tokens."""
    k, b, length, n = mixer.config, rec.rows, rec.length, rec.rows * rec.length
    scratch = plan.kimi_scratch
    proj, f = _kda_inputs(plan, mixer, layer, n, length)
    gate = scratch_rows(scratch.gate, n, k.qkv_dim)
    low = scratch_rows(scratch.low, n, k.head_dim)
    y = scratch_rows(plan.narrow, n, k.qkv_dim)
    rec.linear(mixer.in_proj, plan.normed[:n], proj)
    # f_b_proj(f_a) and g_b_proj(g_a): each part of in_proj's rows copied out, then its linear.
    for offset, linear, out in ((k.conv_dim, mixer.f_b_proj, f), (k.conv_dim + k.head_dim, mixer.g_b_proj, gate)):
        rec.emit(Op.COPY_ROWS, [low, proj.view(-1)[offset:], n, k.head_dim, k.head_dim, proj.shape[1]])
        rec.linear(linear, low, out)
    sizes = [b, k.num_heads, k.head_dim, k.conv_kernel, length]
    arguments = _kda_state_arguments(plan, mixer, layer)
    rec.emit(
        Op.KDA if length == 1 else Op.KDA_VERIFY,
        [proj, f, gate, *arguments, mixer.o_norm.weight, plan.xbc[:n], y, *sizes],
        (mixer.o_norm.eps,),
    )
    rec.linear(mixer.o_proj, y, plan.mixed[:n])


def record_kda_shift(rec: Recorder, plan: object, mixer: KimiDeltaAttentionMixer, layer: int) -> None:
    """A KDA layer's shift record after a verification of rec.length tokens: each row's states advance by its
    accepted tokens, from the kept in_proj output and f."""
    k, b, length = mixer.config, rec.rows, rec.length
    proj, f = _kda_inputs(plan, mixer, layer, b * length, length)
    sizes = [b, k.num_heads, k.head_dim, k.conv_kernel, length]
    rec.emit(Op.KDA_SHIFT, [proj, f, *_kda_state_arguments(plan, mixer, layer), plan.xbc[: b * length], *sizes])


def record_mla(rec: Recorder, plan: object, mla: MultiHeadLatentAttention, layer: int) -> None:
    """A latent attention block's records (cache `layer` of the pool), reading `plan.normed`, writing `plan.mixed`."""
    m, b, length, n = mla.config, rec.rows, rec.length, rec.rows * rec.length
    scratch, normed = plan.kimi_scratch, plan.normed[:n]
    q = scratch_rows(plan.wide, n, m.num_heads * m.qk_head_dim)
    if m.q_lora_rank is None:
        rec.linear(mla.q_proj, normed, q)
    else:
        low, norm = scratch_rows(scratch.q_low, n, m.q_lora_rank), mla.q_a_layernorm
        rec.linear(mla.q_a_proj, normed, low)
        rec.emit(Op.RMS_NORM, [low, norm.weight, low, n, m.q_lora_rank], (norm.eps,))
        rec.linear(mla.q_b_proj, low, q)
    kv = scratch_rows(scratch.kv, n, m.kv_lora_rank + m.qk_rope_head_dim)
    rec.linear(mla.kv_a_proj_with_mqa, normed, kv)
    out = scratch_rows(plan.narrow, n, m.num_heads * m.v_head_dim)
    blocks = plan.pool.blocks
    rec.emit(
        Op.MLA,
        [
            q,
            kv,
            mla.kv_a_layernorm.weight,
            plan.pool.key[layer],
            plan.slot_ids,
            plan.positions[0, :b],
            blocks.tables,
            mla.kv_b,
            out,
            b,
            length,
            m.num_heads,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
            plan.pool.capacity,
            blocks.max_blocks_per_slot,
            blocks.block_size,
        ],
        (mla.scale, mla.kv_a_layernorm.eps),
    )
    rec.linear(mla.o_proj, out, plan.mixed[:n])
