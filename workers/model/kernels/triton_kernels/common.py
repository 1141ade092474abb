"""Kernels shared by Mamba2 and Gated DeltaNet: the causal conv step, the conv window shift, the gated RMSNorm.

Conv windows are [b, c, W-1] (the last W-1 conv inputs, oldest first), in the model dtype; arithmetic is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONV_BLOCK = 256  # channels per program


@triton.jit
def window_taps_(acc, column, w_sw, weight_row, mask, new, W: tl.constexpr):
    """acc + Σ_{j < W-1} weight[c, j] · window[c, j], oldest column first (float32); the window (`column`: channel
    c's first entry, w_sw apart) drops its oldest column and gains `new`, in the window's dtype."""
    for j in tl.static_range(W - 1):  # load column j, then move it to j - 1 (column j - 1 is already read)
        old = tl.load(column + j * w_sw, mask=mask, other=0.0)
        acc += tl.load(weight_row + j, mask=mask, other=0.0).to(tl.float32) * old.to(tl.float32)
        if j > 0:
            tl.store(column + (j - 1) * w_sw, old, mask=mask)
    tl.store(column + (W - 2) * w_sw, new.to(column.dtype.element_ty), mask=mask)
    return acc


@triton.jit
def _conv_step_kernel(
    x_ptr,
    x_stride,
    window_ptr,
    w_sb,
    w_sc,
    w_sw,
    weight_ptr,
    bias_ptr,
    out_ptr,
    out_stride,
    channels,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = silu(Σ_j weight[c, j] · [window, x][c, j] + bias[c]); the window drops its oldest column, gains x."""
    row, block = tl.program_id(0), tl.program_id(1)
    c = block * BLOCK + tl.arange(0, BLOCK)
    mask = c < channels
    new = tl.load(x_ptr + row * x_stride + c, mask=mask, other=0.0)
    acc = tl.load(weight_ptr + c * W + (W - 1), mask=mask, other=0.0).to(tl.float32) * new.to(tl.float32)
    acc = window_taps_(acc, window_ptr + row * w_sb + c * w_sc, w_sw, weight_ptr + c * W, mask, new, W)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * out_stride + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def conv_step_(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token per row through the depthwise causal conv + SiLU, shifting `window` [b, c, W-1] in place.

    x [b, c] (a column slice of the in_proj output is fine: unit stride along c); weight [c, W] contiguous.
    Returns out [b, c] in x's dtype (as `ssd.conv_step_` rounds it).
    """
    b, channels = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and window.shape[1] == channels
    out = torch.empty(b, channels, dtype=x.dtype, device=x.device)
    grid = (b, triton.cdiv(channels, CONV_BLOCK))
    _conv_step_kernel[grid](
        x,
        x.stride(0),
        window,
        *window.stride(),
        weight,
        bias if bias is not None else weight,
        out,
        out.stride(0),
        channels,
        W=weight.shape[1],
        HAS_BIAS=bias is not None,
        BLOCK=CONV_BLOCK,
    )
    return out


@triton.jit
def _conv_shift_kernel(
    inputs_ptr,
    i_sb,
    i_sl,
    window_ptr,
    w_sb,
    w_sc,
    w_sw,
    accepted_ptr,
    channels,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """window ← the last W-1 columns of [window, inputs_0 … inputs_{n-1}], n = accepted[row] ≥ 1; column j reads
    index n + j ≥ j + 1 of that concatenation, which nothing before it has overwritten."""
    row, block = tl.program_id(0), tl.program_id(1)
    c = block * BLOCK + tl.arange(0, BLOCK)
    mask = c < channels
    n = tl.load(accepted_ptr + row)
    column = window_ptr + row * w_sb + c * w_sc
    for j in tl.static_range(W - 1):
        source = tl.zeros([BLOCK], dtype=tl.int32) + n + j  # per channel, so masks are blocks
        from_window = source < W - 1
        old = tl.load(column + tl.minimum(source, W - 2) * w_sw, mask=mask & from_window, other=0.0)
        t = tl.maximum(source - (W - 1), 0)
        new = tl.load(inputs_ptr + row * i_sb + t * i_sl + c, mask=mask & (source >= W - 1), other=0.0)
        value = tl.where(from_window, old.to(tl.float32), new.to(tl.float32))
        tl.store(column + j * w_sw, value.to(window_ptr.dtype.element_ty), mask=mask)


def conv_shift_(window: torch.Tensor, conv_inputs: torch.Tensor, num_accepted_tokens: torch.Tensor) -> None:
    """In place: each row's window [b, c, W-1] becomes the one after its first num_accepted_tokens [b] (1 … l) conv
    inputs [b, l, c] of a verification that started from it (`ssd.conv_window_after`)."""
    b, _, channels = conv_inputs.shape
    assert conv_inputs.stride(2) == 1
    accepted = num_accepted_tokens.to(device=window.device, dtype=torch.int32)
    grid = (b, triton.cdiv(channels, CONV_BLOCK))
    _conv_shift_kernel[grid](
        conv_inputs,
        conv_inputs.stride(0),
        conv_inputs.stride(1),
        window,
        *window.stride(),
        accepted,
        channels,
        W=window.shape[2] + 1,
        BLOCK=CONV_BLOCK,
    )


@triton.jit
def _gated_norm_kernel(
    y_ptr,
    y_stride,
    z_ptr,
    z_stride,
    weight_ptr,
    weight_group_stride,
    out_ptr,
    out_stride,
    group_size,
    eps,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One group of one row: weight · rmsnorm(y) · silu(z) (NORM_BEFORE_GATE) or weight · rmsnorm(y), y gated."""
    row, group = tl.program_id(0), tl.program_id(1)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < group_size
    c = group * group_size + offsets
    y = tl.load(y_ptr + row * y_stride + c, mask=mask, other=0.0).to(tl.float32)
    normed = y * tl.rsqrt(tl.sum(y * y, axis=0) / group_size + eps)
    weight = tl.load(weight_ptr + group * weight_group_stride + offsets, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed
    if NORM_BEFORE_GATE:
        z = tl.load(z_ptr + row * z_stride + c, mask=mask, other=0.0).to(tl.float32)
        out = out * z * tl.sigmoid(z)
    tl.store(out_ptr + row * out_stride + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_norm(
    y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, num_groups: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """y [b, c] float32 → [b, c] in `dtype`, RMS-normalised per group of c / num_groups channels, × weight.

    z None: y is already gated (Mamba2: rmsnorm(y · silu(z)), weight [c]). z [b, c]: gate after the norm (Gated
    DeltaNet: weight [c / num_groups], one per head channel, shared by the heads).
    """
    b, channels = y.shape
    group_size = channels // num_groups
    weight_group_stride = group_size if weight.numel() == channels else 0
    assert weight.numel() in (channels, group_size) and (z is None or z.stride(1) == 1)
    out = torch.empty(b, channels, dtype=dtype, device=y.device)
    _gated_norm_kernel[(b, num_groups)](
        y,
        y.stride(0),
        z if z is not None else y,
        z.stride(0) if z is not None else 0,
        weight,
        weight_group_stride,
        out,
        out.stride(0),
        group_size,
        eps,
        NORM_BEFORE_GATE=z is not None,
        BLOCK=triton.next_power_of_2(group_size),
    )
    return out
