"""Gated DeltaNet decode step and post-verification state shift in Triton (NOTES.md §8).

Step, per row: conv step (SiLU, no bias) over q, k, v → per (value head, block of d_v columns): l2norm q and k of
key head j // r, q · d_k^-0.5, g = −exp(A_log) · softplus(a + dt_bias), beta = beta_scale · sigmoid(b) (OLMo-Hybrid's
2, else 1), then S ← S·exp(g); S += k ⊗ beta·(v − Sᵀk); o = Sᵀq (in place, float32; the d_v columns of S are
independent) → per-head gated norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.model.kernels.triton_kernels.common import conv_shift_, conv_step_, gated_norm
from workers.model.kernels.triton_kernels.mamba2 import _softplus

VALUE_BLOCK = 32  # d_v columns per program: [d_k, 32] state tiles


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _delta_step(S, k, v, g, beta):
    """S [d_k, block of d_v]: decay by exp(g) (a head's scalar, or KDA's per key channel g [d_k, 1]), then write
    beta · (v − Sᵀk) along k."""
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    return S + k[:, None] * delta[None, :]


@triton.jit
def _state_tile(state_ptr, s_sb, s_sh, s_sk, DK, DV, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's (row, head, block of d_v columns) from its ids: row, head, key indices kk, value columns vv,
    their masks, the [d_k, block] mask and the state tile's pointers."""
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = block * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = kk < DK, vv < DV
    tile = state_ptr + row * s_sb + head * s_sh + kk[:, None] * s_sk + vv[None, :]
    return row, head, kk, vv, mask_k, mask_v, mask_k[:, None] & mask_v[None, :], tile


@triton.jit
def _delta_step_kernel(
    qkv_ptr,
    qkv_stride,
    proj_ptr,
    proj_stride,
    state_ptr,
    s_sb,
    s_sh,
    s_sk,
    A_log_ptr,
    dt_bias_ptr,
    o_ptr,
    o_stride,
    key_dim,
    gates_offset,
    num_value_heads,
    repeats,
    scale,
    beta_scale,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, head, kk, vv, mask_k, mask_v, mask, tile = _state_tile(state_ptr, s_sb, s_sh, s_sk, DK, DV, BLOCK_K, BLOCK_V)
    key_head = head // repeats  # value head j reads key head j // r (repeat_interleave)
    qkv = qkv_ptr + row * qkv_stride
    q = _l2norm(tl.load(qkv + key_head * DK + kk, mask=mask_k, other=0.0).to(tl.float32)) * scale
    k = _l2norm(tl.load(qkv + key_dim + key_head * DK + kk, mask=mask_k, other=0.0).to(tl.float32))
    v = tl.load(qkv + 2 * key_dim + head * DV + vv, mask=mask_v, other=0.0).to(tl.float32)
    gates = proj_ptr + row * proj_stride + gates_offset
    beta = tl.sigmoid(tl.load(gates + head).to(tl.float32)) * beta_scale
    a = tl.load(gates + num_value_heads + head).to(tl.float32) + tl.load(dt_bias_ptr + head)
    g = -tl.exp(tl.load(A_log_ptr + head)) * _softplus(a)
    S = _delta_step(tl.load(tile, mask=mask, other=0.0), k, v, g, beta)
    tl.store(tile, S, mask=mask)
    tl.store(o_ptr + row * o_stride + head * DV + vv, tl.sum(S * q[:, None], axis=0), mask=mask_v)


def gdn_decode_step(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_key_heads: int,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """One token per row: proj [b, conv_dim + value_dim + 2·h_v] (in_proj output, `[q | k | v | z | b | a]`) → the
    out_proj input [b, value_dim] in proj's dtype. conv_state [b, conv_dim, W-1] and state [b, h_v, d_k, d_v]
    (float32, unit stride along d_v) are updated in place — what `GatedDeltaNetMixer`'s in-place decode computes.
    beta = beta_scale · sigmoid(b) (OLMo-Hybrid's 2 allows negative eigenvalues)."""
    b, num_value_heads, key_head_dim, value_head_dim = state.shape
    conv_dim, value_dim = conv_weight.shape[0], num_value_heads * value_head_dim
    key_dim = num_key_heads * key_head_dim
    assert proj.stride(1) == 1 and state.stride(3) == 1 and state.dtype == torch.float32
    qkv = conv_step_(proj[:, :conv_dim], conv_state, conv_weight, None)
    o = torch.empty(b, value_dim, dtype=torch.float32, device=proj.device)
    block_v = min(VALUE_BLOCK, triton.next_power_of_2(value_head_dim))
    _delta_step_kernel[(b, num_value_heads, triton.cdiv(value_head_dim, block_v))](
        qkv,
        qkv.stride(0),
        proj,
        proj.stride(0),
        state,
        *state.stride()[:3],
        A_log,
        dt_bias,
        o,
        o.stride(0),
        key_dim,
        conv_dim + value_dim,
        num_value_heads,
        num_value_heads // num_key_heads,
        key_head_dim**-0.5,
        float(beta_scale),
        DK=key_head_dim,
        DV=value_head_dim,
        BLOCK_K=triton.next_power_of_2(key_head_dim),
        BLOCK_V=block_v,
    )
    z = proj[:, conv_dim : conv_dim + value_dim]
    return gated_norm(o, z, norm_weight, num_value_heads, eps, proj.dtype)


@triton.jit
def _delta_shift_kernel(
    k_ptr,
    k_sb,
    k_sl,
    v_ptr,
    v_sb,
    v_sl,
    g_ptr,
    g_sb,
    g_sl,
    beta_ptr,
    beta_sb,
    beta_sl,
    state_ptr,
    s_sb,
    s_sh,
    s_sk,
    accepted_ptr,
    length,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PER_CHANNEL_G: tl.constexpr,
):
    """One (row, head, block of d_v columns): replay the row's accepted inputs. g is a head's scalar (GDN) or, with
    PER_CHANNEL_G, one decay per key channel (KDA)."""
    row, head, kk, vv, mask_k, mask_v, mask, tile = _state_tile(state_ptr, s_sb, s_sh, s_sk, DK, DV, BLOCK_K, BLOCK_V)
    accepted = tl.load(accepted_ptr + row)
    S = tl.load(tile, mask=mask, other=0.0)
    for t in range(length):  # steps past a row's count have g = beta = 0: exact no-ops
        valid = t < accepted
        g_row = g_ptr + row * g_sb + t * g_sl
        if PER_CHANNEL_G:
            g = tl.where(valid, tl.load(g_row + head * DK + kk, mask=mask_k, other=0.0), 0.0)[:, None]
        else:
            g = tl.where(valid, tl.load(g_row + head), 0.0)
        beta = tl.where(valid, tl.load(beta_ptr + row * beta_sb + t * beta_sl + head), 0.0)
        k = tl.load(k_ptr + row * k_sb + t * k_sl + head * DK + kk, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + row * v_sb + t * v_sl + head * DV + vv, mask=mask_v, other=0.0)
        S = _delta_step(S, k, v, g, beta)
    tl.store(tile, S, mask=mask)


def gdn_shift_(
    conv_state: torch.Tensor,
    state: torch.Tensor,
    conv_in: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """In place: the states a verification started from become those after input num_accepted_tokens − 1.

    conv_state [b, conv_dim, W-1], state [b, h_v, d_k, d_v] float32; the verification's scan inputs conv_in
    [b, l, conv_dim], k [b, l, h_v, d_k], v [b, l, h_v, d_v], g [b, l, h_v] (or [b, l, h_v, d_k]: a decay per key
    channel, as Kimi Delta Attention's), beta [b, l, h_v] (float32); num_accepted_tokens [b] in 1 … l, on the device.
    Same result as `GatedDeltaNetMixer.state_after` (`KimiDeltaAttentionMixer.state_after` with per-channel g).
    """
    b, length, num_value_heads, key_head_dim = k.shape
    value_head_dim = v.shape[-1]
    k, v, g, beta = (t.float().contiguous() for t in (k, v, g, beta))
    assert state.stride(3) == 1 and state.dtype == torch.float32
    conv_shift_(conv_state, conv_in, num_accepted_tokens)
    accepted = num_accepted_tokens.to(device=state.device, dtype=torch.int32)
    block_v = min(VALUE_BLOCK, triton.next_power_of_2(value_head_dim))
    _delta_shift_kernel[(b, num_value_heads, triton.cdiv(value_head_dim, block_v))](
        k,
        k.stride(0),
        k.stride(1),
        v,
        v.stride(0),
        v.stride(1),
        g,
        g.stride(0),
        g.stride(1),
        beta,
        beta.stride(0),
        beta.stride(1),
        state,
        *state.stride()[:3],
        accepted,
        length,
        DK=key_head_dim,
        DV=value_head_dim,
        BLOCK_K=triton.next_power_of_2(key_head_dim),
        BLOCK_V=block_v,
        PER_CHANNEL_G=g.dim() == 4,
    )
