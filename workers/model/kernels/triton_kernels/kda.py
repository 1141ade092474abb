"""Kimi Delta Attention (Kimi-Linear) decode step and post-verification state shift in Triton.

Step, per row (the conv step is `common.conv_step_`; f_b_proj and g_b_proj are GEMMs before it): per (head, block
of d_v columns) l2norm q and k, q · d^-0.5, a decay per key channel g = −exp(A_log[h]) · softplus(f + dt_bias),
beta = sigmoid(b), then S ← S · exp(g)[:, None]; S += k ⊗ beta · (v − Sᵀk) (`gdn._delta_step`); o = Sᵀq (in place, float32; the d_v
columns of S are independent) → per head weight · rmsnorm(o) · sigmoid(gate). Shift: re-run the accepted inputs'
delta rule from the state verification started from: `gdn.gdn_shift_` with per-channel g (no kernel here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.model.kernels.triton_kernels.common import conv_step_
from workers.model.kernels.triton_kernels.gdn import VALUE_BLOCK, _delta_step, _l2norm, _state_tile
from workers.model.kernels.triton_kernels.mamba2 import _softplus


@triton.jit
def _kda_step_kernel(
    qkv_ptr,
    qkv_stride,
    f_ptr,
    f_stride,
    b_ptr,
    b_stride,
    state_ptr,
    s_sb,
    s_sh,
    s_sk,
    A_log_ptr,
    dt_bias_ptr,
    o_ptr,
    o_stride,
    width,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, head, kk, vv, mask_k, mask_v, mask, tile = _state_tile(state_ptr, s_sb, s_sh, s_sk, D, D, BLOCK_D, BLOCK_V)
    qkv = qkv_ptr + row * qkv_stride + head * D
    q = _l2norm(tl.load(qkv + kk, mask=mask_k, other=0.0).to(tl.float32)) * scale
    k = _l2norm(tl.load(qkv + width + kk, mask=mask_k, other=0.0).to(tl.float32))
    v = tl.load(qkv + 2 * width + vv, mask=mask_v, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + row * f_stride + head * D + kk, mask=mask_k, other=0.0).to(tl.float32)
    f += tl.load(dt_bias_ptr + head * D + kk, mask=mask_k, other=0.0).to(tl.float32)
    g = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32)) * _softplus(f)
    beta = tl.sigmoid(tl.load(b_ptr + row * b_stride + head).to(tl.float32))
    S = _delta_step(tl.load(tile, mask=mask, other=0.0), k, v, g[:, None], beta)
    tl.store(tile, S, mask=mask)
    tl.store(o_ptr + row * o_stride + head * D + vv, tl.sum(S * q[:, None], axis=0), mask=mask_v)


@triton.jit
def _sigmoid_norm_kernel(
    o_ptr, o_stride, gate_ptr, gate_stride, weight_ptr, out_ptr, out_stride, eps, D: tl.constexpr, BLOCK: tl.constexpr
):
    """One head of one row: weight · rmsnorm(o) · sigmoid(gate)."""
    row, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < D
    o = tl.load(o_ptr + row * o_stride + head * D + d, mask=mask, other=0.0)
    gate = tl.load(gate_ptr + row * gate_stride + head * D + d, mask=mask, other=0.0).to(tl.float32)
    normed = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32) * (o * tl.rsqrt(tl.sum(o * o) / D + eps))
    tl.store(out_ptr + row * out_stride + head * D + d, (normed * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty), mask)


def kda_decode_step(
    conv_in: torch.Tensor,
    f: torch.Tensor,
    b_raw: torch.Tensor,
    gate: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """One token per row → the o_proj input [b, h·d] in conv_in's dtype; conv_state [b, 3·h·d, W-1] and state
    [b, h, d, d] (float32, unit stride along its last dim) updated in place — what `KimiDeltaAttentionMixer`'s
    in-place decode computes. conv_in [b, 3·h·d] (q, k, v before the conv), f = f_b_proj(f_a) and gate =
    g_b_proj(g_a) [b, h·d], b_raw [b, h]: slices of the projections (unit stride along the last dim)."""
    b, num_heads, head_dim, _ = state.shape
    width = num_heads * head_dim
    assert state.stride(3) == 1 and state.dtype == torch.float32
    assert all(t.stride(-1) == 1 for t in (conv_in, f, b_raw, gate)) and dt_bias.is_contiguous()
    qkv = conv_step_(conv_in, conv_state, conv_weight, None)
    o = torch.empty(b, width, dtype=torch.float32, device=conv_in.device)
    block_v = min(VALUE_BLOCK, triton.next_power_of_2(head_dim))
    _kda_step_kernel[(b, num_heads, triton.cdiv(head_dim, block_v))](
        qkv,
        qkv.stride(0),
        f,
        f.stride(0),
        b_raw,
        b_raw.stride(0),
        state,
        *state.stride()[:3],
        A_log,
        dt_bias,
        o,
        o.stride(0),
        width,
        head_dim**-0.5,
        D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_V=block_v,
    )
    out = torch.empty(b, width, dtype=conv_in.dtype, device=conv_in.device)
    block = triton.next_power_of_2(head_dim)
    _sigmoid_norm_kernel[(b, num_heads)](
        o, o.stride(0), gate, gate.stride(0), norm_weight, out, out.stride(0), eps, D=head_dim, BLOCK=block
    )
    return out
