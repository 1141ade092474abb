"""The records of LFM2 / LFM2-MoE / LFM3 and OLMo-Hybrid blocks in a decode plan, as the module path's native calls.

- LFM2's gated short conv: in_proj, `csrc/short_conv.c` (decode step, verification, keep), out_proj.
- LFM3's per-head output gate (`g_proj`): its one value per head repeated over the head's channels, then the
  `sigmoid_mul` that `Attention._output` calls (the sliding window and proportional RoPE are attention records'
  arguments, in `decode_records.py`).
- Norms after the mixer: LFM3's sandwich norms and OLMo's post-norm blocks norm the mixer's output (in place, the
  kernel `block.post_norm` calls) before the residual add. Before a post-norm block the residual add has no norm
  after it (`PassThroughNorm`): the next mixer reads the residual stream itself, so it is copied into `normed`.
OLMo's Gated DeltaNet (beta = 2·sigmoid(b)) and whole-width q/k norms are the GDN and attention records' own.
"""

from __future__ import annotations

import torch

from workers.model.layers.attention import Attention
from workers.model.layers.norm import PassThroughNorm
from workers.model.layers.short_conv import ShortConvMixer
from workers.model.steps.plan_records import Op, Recorder, scratch_rows


class HeadGateScratch:
    """Buffers for LFM3's per-head output gates over up to `tokens` rows: g_proj's outputs [tokens, H] and their
    repetition over each head's channels [tokens, H · head_dim] (empty for models without such gates)."""

    def __init__(self, model: torch.nn.Module, tokens: int):
        gated = [m for m in model.modules() if isinstance(m, Attention) and m.g_proj is not None]
        self.heads = torch.empty(tokens * max((m.config.num_heads for m in gated), default=0))
        width = max((m.config.num_heads * m.config.head_dim for m in gated), default=0)
        self.repeated = torch.empty(tokens * width)


def post_norm_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model`'s norms after the mixer cannot be recorded, or None when they can."""
    post_norms = [block.post_norm for block in model.blocks if block.post_norm is not None]
    if not all(norm.native for norm in post_norms):
        return "the native kernels are off (not CPU float32, or decode_kernel / linear_backend chose another path)"
    pass_through = any(isinstance(block.norm, PassThroughNorm) for block in model.blocks)
    if pass_through and model.config.residual_multiplier != 1.0:  # no such checkpoint: torch.add's α rounding
        return "post-norm blocks with a residual multiplier are not covered"
    return None


def record_first_norm(rec: Recorder, model: torch.nn.Module, hidden: torch.Tensor, normed: torch.Tensor) -> None:
    """normed = the first block's pre-norm of the embeddings (a copy when that block is post-norm)."""
    n, d = hidden.shape
    norm = model.blocks[0].norm if model.blocks else model.final_norm
    if isinstance(norm, PassThroughNorm):
        rec.emit(Op.COPY, [normed, hidden, n * d])
    else:
        rec.emit(Op.RMS_NORM, [hidden, norm.weight, normed, n, d], (norm.eps,))


def record_residual(
    rec: Recorder, block: torch.nn.Module, next_norm: torch.nn.Module, plan: object, residual_multiplier: float
) -> None:
    """The end of a block as `HybridModel.forward` runs it: the post-norm of `mixed` (in place) where the block has
    one, then hidden += α · mixed fused with the next block's pre-norm into `normed` (a copy of hidden when the next
    block is post-norm). `plan` holds the buffers `hidden`, `mixed`, `normed`."""
    n, d = rec.rows * rec.length, plan.hidden.shape[1]
    hidden, mixed, normed = plan.hidden[:n], plan.mixed[:n], plan.normed[:n]
    if block.post_norm is not None:
        norm = block.post_norm
        rec.emit(Op.RMS_NORM, [mixed, norm.weight, mixed, n, d], (norm.eps,))
    if isinstance(next_norm, PassThroughNorm):  # α is 1 there (`post_norm_unsupported_reason`): an exact add
        rec.emit(Op.ADD, [hidden, mixed, hidden, n * d])
        rec.emit(Op.COPY, [normed, hidden, n * d])
    else:
        rec.emit(Op.ADD_RMS_NORM, [hidden, mixed, next_norm.weight, normed, n, d], (residual_multiplier, next_norm.eps))


def _short_conv_arguments(mixer: ShortConvMixer, plan: object, layer: int, n: int) -> list:
    """The kernels' arguments from the conv window to the u scratch (csrc/short_conv.c)."""
    return [plan.pool.conv[layer], mixer.conv1d.weight, mixer.conv1d.bias, plan.xbc[:n]]


def record_short_conv(rec: Recorder, mixer: ShortConvMixer, plan: object, layer: int) -> None:
    """A short-conv block's records: in_proj into the kept projections (a verification: `keep` re-reads them) or
    scratch, the conv step (or verification, leaving the windows), out_proj into `mixed`."""
    b, length, n = rec.rows, rec.length, rec.rows * rec.length
    d, taps = mixer.conv1d.weight.shape[0], mixer.conv1d.weight.shape[2]
    width = mixer.in_proj.out_features
    proj = plan._projections(width, layer, n, length)
    y = scratch_rows(plan.narrow, n, d)
    rec.linear(mixer.in_proj, plan.normed[:n], proj.view(n, width))
    arguments = [proj, *_short_conv_arguments(mixer, plan, layer, n), y, b, d, taps]
    if length == 1:
        rec.emit(Op.SHORT_CONV, arguments)
    else:
        rec.emit(Op.SHORT_CONV_VERIFY, [*arguments, length])
    rec.linear(mixer.out_proj, y, plan.mixed[:n])


def record_short_conv_shift(rec: Recorder, mixer: ShortConvMixer, plan: object, layer: int) -> None:
    """The keep after a verification: each row's window after its accepted inputs, from the kept projections."""
    b, length, n = rec.rows, rec.length, rec.rows * rec.length
    d, taps = mixer.conv1d.weight.shape[0], mixer.conv1d.weight.shape[2]
    kept = plan.kept_proj[layer, : n * mixer.in_proj.out_features]
    rec.emit(Op.SHORT_CONV_SHIFT, [kept, *_short_conv_arguments(mixer, plan, layer, n), b, d, taps, length])


def record_head_gate(rec: Recorder, attention: Attention, plan: object, out: torch.Tensor) -> None:
    """LFM3's output gate, as `Attention._project` / `_output` compute it: out ← out · sigmoid(g_proj(normed)
    repeated over each head's head_dim channels)."""
    a, n = attention.config, rec.rows * rec.length
    width = a.num_heads * a.head_dim
    heads = scratch_rows(plan.head_gates.heads, n, a.num_heads)
    repeated = scratch_rows(plan.head_gates.repeated, n, width)
    rec.linear(attention.g_proj, plan.normed[:n], heads)
    rec.emit(Op.REPEAT_HEADS, [heads, repeated, n * a.num_heads, a.head_dim])
    rec.emit(Op.SIGMOID_MUL, [out, repeated, out, n, width])
