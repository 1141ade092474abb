"""Mamba (version 1, Jamba) selective state update and post-verification state shift in Triton.

Step, per row and block of channels (the conv step is `common.conv_step_`; x_proj, the inner norms and dt_proj are
GEMMs around it): h[c, :] = h[c, :] · exp(dt[c] · A[c, :]) + dt[c] · x[c] · B (in place, float32), y = h · C +
D · x, y · silu(z). A [i, n] = −exp(A_log) differs per channel *and* state index, unlike Mamba2's one per head.
Shift: re-run the accepted inputs' recurrence from the state verification started from (dt = 0 past a row's count
makes a step an exact no-op), as `selective_scan.selective_state_after` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.model.kernels.triton_kernels.common import conv_shift_

CHANNEL_BLOCK = 32  # channels per program: [32, n] state tiles


@triton.jit
def _channel_tile(
    A_log_ptr, row_state_ptr, s_si, channels, N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr
):
    """This program's block of channels (program id 1): c, n, their masks, the [c, n] mask, A = −exp(A_log) [c, n]
    (float32) and the row's state tile pointers [c, n]."""
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = tl.arange(0, BLOCK_N)
    mask_c, mask_n = c < channels, n < N
    mask = mask_c[:, None] & mask_n[None, :]
    A = -tl.exp(tl.load(A_log_ptr + c[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32))
    return c, n, mask_c, mask_n, mask, A, row_state_ptr + c[:, None] * s_si + n[None, :]


@triton.jit
def _selective_update(h, A, dt, x, B):
    """h [c, n] ← h · exp(dt · A) + (dt · x) ⊗ B, dt and x per channel (dt = 0: h unchanged)."""
    return h * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * B[None, :]


@triton.jit
def _selective_step_kernel(
    x_ptr,
    x_stride,
    dt_ptr,
    dt_stride,
    B_ptr,
    B_stride,
    C_ptr,
    C_stride,
    z_ptr,
    z_stride,
    A_log_ptr,
    D_ptr,
    state_ptr,
    s_sb,
    s_si,
    y_ptr,
    y_stride,
    channels,
    N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    c, n, mask_c, mask_n, mask, A, tile = _channel_tile(
        A_log_ptr, state_ptr + row * s_sb, s_si, channels, N, BLOCK_C, BLOCK_N
    )
    x = tl.load(x_ptr + row * x_stride + c, mask=mask_c, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * dt_stride + c, mask=mask_c, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + row * B_stride + n, mask=mask_n, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + row * C_stride + n, mask=mask_n, other=0.0).to(tl.float32)
    h = _selective_update(tl.load(tile, mask=mask, other=0.0), A, dt, x, B)
    tl.store(tile, h, mask=mask)
    y = tl.sum(h * C[None, :], axis=1) + tl.load(D_ptr + c, mask=mask_c, other=0.0).to(tl.float32) * x
    z = tl.load(z_ptr + row * z_stride + c, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + c, (y * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask_c)


def selective_step_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token per row: the out_proj input (h · C + D · x) · silu(z) [b, i] in x's dtype, `state` [b, i, n]
    (float32, unit stride along n; any other strides) updated in place. x, z [b, i] (unit stride along i: column
    slices are fine); dt [b, i] after softplus; A_log [i, n] contiguous; B, C [b, n]; D [i]. What `Mamba1Mixer`'s
    in-place decode computes after its conv step."""
    b, channels, size = state.shape
    assert state.stride(2) == 1 and state.dtype == torch.float32 and A_log.is_contiguous()
    assert all(t.stride(-1) == 1 for t in (x, dt, B, C, z))
    y = torch.empty(b, channels, dtype=x.dtype, device=x.device)
    block_c = min(CHANNEL_BLOCK, triton.next_power_of_2(channels))
    _selective_step_kernel[(b, triton.cdiv(channels, block_c))](
        x,
        x.stride(0),
        dt,
        dt.stride(0),
        B,
        B.stride(0),
        C,
        C.stride(0),
        z,
        z.stride(0),
        A_log,
        D,
        state,
        state.stride(0),
        state.stride(1),
        y,
        y.stride(0),
        channels,
        N=size,
        BLOCK_C=block_c,
        BLOCK_N=triton.next_power_of_2(size),
    )
    return y


@triton.jit
def _selective_shift_kernel(
    x_ptr,
    x_sb,
    x_sl,
    dt_ptr,
    dt_sb,
    dt_sl,
    B_ptr,
    B_sb,
    B_sl,
    A_log_ptr,
    state_ptr,
    s_sb,
    s_si,
    accepted_ptr,
    length,
    channels,
    N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    c, n, mask_c, mask_n, mask, A, tile = _channel_tile(
        A_log_ptr, state_ptr + row * s_sb, s_si, channels, N, BLOCK_C, BLOCK_N
    )
    accepted = tl.load(accepted_ptr + row)
    h = tl.load(tile, mask=mask, other=0.0)
    for t in range(length):  # every row runs `length` steps; those past its count have dt = 0 (no-ops)
        dt = tl.load(dt_ptr + row * dt_sb + t * dt_sl + c, mask=mask_c, other=0.0).to(tl.float32)
        dt = tl.where(t < accepted, dt, 0.0)
        x = tl.load(x_ptr + row * x_sb + t * x_sl + c, mask=mask_c, other=0.0).to(tl.float32)
        B = tl.load(B_ptr + row * B_sb + t * B_sl + n, mask=mask_n, other=0.0).to(tl.float32)
        h = _selective_update(h, A, dt, x, B)
    tl.store(tile, h, mask=mask)


def mamba1_shift_(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_in: torch.Tensor,
    x: torch.Tensor,
    B: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """In place: the states a verification started from become those after input num_accepted_tokens − 1.

    conv_state [b, i, W-1], ssm_state [b, i, n] float32 (unit stride along n); the verification's scan inputs
    conv_in, x [b, l, i], B [b, l, n], dt [b, l, i] (after softplus); A_log [i, n] contiguous; num_accepted_tokens
    [b] in 1 … l, on the device (no host sync). Same result as `Mamba1Mixer.state_after`.
    """
    b, length, channels = x.shape
    size = ssm_state.shape[-1]
    x, B, dt = x.contiguous(), B.contiguous(), dt.contiguous()
    assert ssm_state.stride(2) == 1 and ssm_state.dtype == torch.float32 and A_log.is_contiguous()
    conv_shift_(conv_state, conv_in, num_accepted_tokens)
    accepted = num_accepted_tokens.to(device=ssm_state.device, dtype=torch.int32)
    block_c = min(CHANNEL_BLOCK, triton.next_power_of_2(channels))
    _selective_shift_kernel[(b, triton.cdiv(channels, block_c))](
        x,
        x.stride(0),
        x.stride(1),
        dt,
        dt.stride(0),
        dt.stride(1),
        B,
        B.stride(0),
        B.stride(1),
        A_log,
        ssm_state,
        ssm_state.stride(0),
        ssm_state.stride(1),
        accepted,
        length,
        channels,
        N=size,
        BLOCK_C=block_c,
        BLOCK_N=triton.next_power_of_2(size),
    )
