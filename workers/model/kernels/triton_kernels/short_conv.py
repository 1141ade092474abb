"""LFM2's gated short convolution, one token per row, in Triton (the "conv" layers of LFM2, LFM2-MoE and LFM3).

Step, per row and block of channels: u = B · x (rounded to the model dtype, as the window stores it), conv =
Σ_j weight[c, j] · [window, u][c, j] + bias[c] (no activation), out = C · conv; the window drops its oldest column
and gains u. The state shift after verification is `common.conv_shift_` over the kept u.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.model.kernels.triton_kernels.common import CONV_BLOCK, window_taps_


@triton.jit
def _short_conv_step_kernel(
    proj_ptr,
    proj_stride,
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
    row, block = tl.program_id(0), tl.program_id(1)
    c = block * BLOCK + tl.arange(0, BLOCK)
    mask = c < channels
    proj = proj_ptr + row * proj_stride
    gate_b = tl.load(proj + c, mask=mask, other=0.0)
    gate_c = tl.load(proj + channels + c, mask=mask, other=0.0)
    x = tl.load(proj + 2 * channels + c, mask=mask, other=0.0)
    u = (gate_b.to(tl.float32) * x.to(tl.float32)).to(proj_ptr.dtype.element_ty)
    acc = window_taps_(
        tl.zeros([BLOCK], dtype=tl.float32), window_ptr + row * w_sb + c * w_sc, w_sw, weight_ptr + c * W, mask, u, W
    )
    # The newest tap last: the torch step's order of summation (oldest column first).
    acc += tl.load(weight_ptr + c * W + (W - 1), mask=mask, other=0.0).to(tl.float32) * u.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    conv = acc.to(proj_ptr.dtype.element_ty).to(tl.float32)  # the conv output in the model dtype, then C · it
    tl.store(out_ptr + row * out_stride + c, (gate_c.to(tl.float32) * conv).to(out_ptr.dtype.element_ty), mask=mask)


def short_conv_decode_step(
    proj: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One token per row: proj [b, 3d] (in_proj output `[B | C | x]`, unit stride along it) → the out_proj input
    C · conv(B · x) [b, d] in proj's dtype; `window` [b, d, W-1] (any strides) shifts in place. weight [d, W]
    contiguous. What `ShortConvMixer`'s in-place decode computes."""
    b, width = proj.shape
    channels = width // 3
    assert proj.stride(1) == 1 and weight.is_contiguous() and window.shape[1] == channels == weight.shape[0]
    out = torch.empty(b, channels, dtype=proj.dtype, device=proj.device)
    _short_conv_step_kernel[(b, triton.cdiv(channels, CONV_BLOCK))](
        proj,
        proj.stride(0),
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
