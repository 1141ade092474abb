"""Mamba2 decode step and post-verification state shift in Triton (NOTES.md §1, §3).

Step, per row: conv step over xBC → per (head, block of p): dt = clamp(softplus(dt + dt_bias)), h = h·exp(dt·A) +
dt·x ⊗ B (in place, float32), y = h·C + D·x, y · silu(z) → grouped RMSNorm. Shift: re-run the accepted inputs'
recurrence from the state verification started from (dt = 0 past a row's count makes a step an exact no-op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.model.kernels.triton_kernels.common import conv_shift_, conv_step_, gated_norm

HEAD_BLOCK = 16  # head channels (p) per program: [16, n] state tiles, h · p / 16 programs per row


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus threshold


@triton.jit
def _ssm_step_kernel(
    xbc_ptr,
    xbc_stride,
    proj_ptr,
    proj_stride,
    state_ptr,
    s_sb,
    s_sh,
    s_sp,
    dt_bias_ptr,
    A_log_ptr,
    D_ptr,
    y_ptr,
    y_stride,
    dt_min,
    dt_max,
    intermediate,
    dt_offset,
    heads_per_group,
    num_groups,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = block * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = p < P, n < N
    group = head // heads_per_group
    xbc = xbc_ptr + row * xbc_stride
    x = tl.load(xbc + head * P + p, mask=mask_p, other=0.0).to(tl.float32)
    B = tl.load(xbc + intermediate + group * N + n, mask=mask_n, other=0.0).to(tl.float32)
    C = tl.load(xbc + intermediate + (num_groups + group) * N + n, mask=mask_n, other=0.0).to(tl.float32)
    dt_raw = tl.load(proj_ptr + row * proj_stride + dt_offset + head).to(tl.float32)
    dt = _softplus(dt_raw + tl.load(dt_bias_ptr + head))
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * -tl.exp(tl.load(A_log_ptr + head)))
    tile = state_ptr + row * s_sb + head * s_sh + p[:, None] * s_sp + n[None, :]
    mask = mask_p[:, None] & mask_n[None, :]
    h = tl.load(tile, mask=mask, other=0.0) * decay + (dt * x)[:, None] * B[None, :]
    tl.store(tile, h, mask=mask)
    y = tl.sum(h * C[None, :], axis=1) + tl.load(D_ptr + head) * x
    z = tl.load(proj_ptr + row * proj_stride + head * P + p, mask=mask_p, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + head * P + p, y * z * tl.sigmoid(z), mask=mask_p)


def mamba2_decode_step(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_limits: tuple[float, float],
    norm_weight: torch.Tensor,
    norm_groups: int,
    eps: float,
    num_groups: int,
) -> torch.Tensor:
    """One token per row: proj [b, I + conv_dim + h] (in_proj output) → the out_proj input [b, I] in proj's dtype.

    conv_state [b, conv_dim, W-1] and ssm_state [b, h, p, n] (float32, unit stride along n) are updated in place —
    exactly what `Mamba2Mixer`'s in-place decode computes. num_groups: B/C groups; norm_groups: gated-norm groups.
    """
    b, num_heads, head_dim, size = ssm_state.shape
    intermediate = num_heads * head_dim
    conv_dim = conv_weight.shape[0]
    assert proj.stride(1) == 1 and ssm_state.stride(3) == 1 and ssm_state.dtype == torch.float32
    xbc = conv_step_(proj[:, intermediate : intermediate + conv_dim], conv_state, conv_weight, conv_bias)
    gated = torch.empty(b, intermediate, dtype=torch.float32, device=proj.device)
    block_p = min(HEAD_BLOCK, triton.next_power_of_2(head_dim))
    _ssm_step_kernel[(b, num_heads, triton.cdiv(head_dim, block_p))](
        xbc,
        xbc.stride(0),
        proj,
        proj.stride(0),
        ssm_state,
        *ssm_state.stride()[:3],
        dt_bias,
        A_log,
        D,
        gated,
        gated.stride(0),
        float(dt_limits[0]),
        float(dt_limits[1]),
        intermediate,
        intermediate + conv_dim,
        num_heads // num_groups,
        num_groups,
        P=head_dim,
        N=size,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(size),
    )
    return gated_norm(gated, None, norm_weight, norm_groups, eps, proj.dtype)


@triton.jit
def _ssm_shift_kernel(
    x_ptr,
    x_sb,
    x_sl,
    B_ptr,
    B_sb,
    B_sl,
    dt_ptr,
    dt_sb,
    dt_sl,
    A_log_ptr,
    state_ptr,
    s_sb,
    s_sh,
    s_sp,
    accepted_ptr,
    length,
    heads_per_group,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = block * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = p < P, n < N
    mask = mask_p[:, None] & mask_n[None, :]
    group = head // heads_per_group
    A = -tl.exp(tl.load(A_log_ptr + head))
    accepted = tl.load(accepted_ptr + row)
    tile = state_ptr + row * s_sb + head * s_sh + p[:, None] * s_sp + n[None, :]
    h = tl.load(tile, mask=mask, other=0.0)
    for t in range(length):  # every row runs `length` steps; those past its count have dt = 0 (no-ops)
        dt = tl.where(t < accepted, tl.load(dt_ptr + row * dt_sb + t * dt_sl + head), 0.0)
        x = tl.load(x_ptr + row * x_sb + t * x_sl + head * P + p, mask=mask_p, other=0.0).to(tl.float32)
        B = tl.load(B_ptr + row * B_sb + t * B_sl + group * N + n, mask=mask_n, other=0.0).to(tl.float32)
        h = h * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
    tl.store(tile, h, mask=mask)


def mamba2_shift_(
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

    conv_state [b, conv_dim, W-1], ssm_state [b, h, p, n] float32; the verification's scan inputs conv_in
    [b, l, conv_dim], x [b, l, h, p], B [b, l, g, n], dt [b, l, h] float32; num_accepted_tokens [b] in 1 … l, on the
    device (no host sync). Same result as `Mamba2Mixer.state_after`.
    """
    b, length, num_heads, head_dim = x.shape
    size = ssm_state.shape[-1]
    x, B, dt = x.contiguous(), B.contiguous(), dt.contiguous()
    assert ssm_state.stride(3) == 1 and ssm_state.dtype == torch.float32
    conv_shift_(conv_state, conv_in, num_accepted_tokens)
    accepted = num_accepted_tokens.to(device=ssm_state.device, dtype=torch.int32)
    block_p = min(HEAD_BLOCK, triton.next_power_of_2(head_dim))
    _ssm_shift_kernel[(b, num_heads, triton.cdiv(head_dim, block_p))](
        x,
        x.stride(0),
        x.stride(1),
        B,
        B.stride(0),
        B.stride(1),
        dt,
        dt.stride(0),
        dt.stride(1),
        A_log,
        ssm_state,
        *ssm_state.stride()[:3],
        accepted,
        length,
        num_heads // B.shape[2],
        P=head_dim,
        N=size,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(size),
    )
