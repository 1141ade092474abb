"""The experts of a MoE step as a Triton grouped GEMM over block-wise FP8 weights (`layers/fp8_experts.py`).

The routed (token, slot) pairs are sorted by expert and padded per expert to `BLOCK_M` rows by `moe.align` (the
layout of the bfloat16 grouped GEMM beside it), so every block of `BLOCK_M` sorted rows multiplies one expert. Per K
tile of 128 the program loads the expert's weight bytes, decodes e4m3 (a bitcast to `tl.float8e4nv` where the GPU
converts FP8, else `fp8_gemm.decode_e4m3_`'s bit formula, which the interpreter runs), multiplies each column by its
block's scale and accumulates `tl.dot` in float32: the weights stay one byte per parameter in memory. A weight's row
blocks may restart at row `split` (an expert's gate rows, then its up rows, quantized apart: their scales are kept
apart too). No host sync and no data-dependent shape; `hybridgen::moe_fp8_grouped_gemm` has a fake (shape-only)
implementation for tracing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from workers.model.kernels.fp8 import FP8_BLOCK, split_scale_rows
from workers.model.kernels.triton_kernels import interpreter_on
from workers.model.kernels.triton_kernels.fp8_gemm import decode_e4m3_, native_fp8
from workers.model.kernels.triton_kernels.moe import BLOCK_M, align

BLOCK_N = 64  # divides FP8_BLOCK


@triton.jit
def _fp8_grouped_gemm_kernel(
    x_ptr,
    rows_ptr,
    w_ptr,
    scale_ptr,
    block_expert_ptr,
    out_ptr,
    N,
    K,
    split,
    split_blocks,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    num_experts,
    FP8_NATIVE: tl.constexpr,
    DOT_IN_X_DTYPE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """out[s, n] = Σ_k x[rows[s], k] · decode(w[e, n, k]) · scale[e, block_row(n), k // BK] for the sorted slots s of
    block `pid_m` (expert e; rows[s] = -1: padding), block_row(n) = n // BK before `split`, then `split_blocks` +
    (n - split) // BK."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # E · N · K passes 2³¹ on the large models
    if expert < num_experts:
        slots = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)  # slots · N passes 2³¹ in long prompts
        rows = tl.load(rows_ptr + slots)
        valid = rows >= 0
        cols = pid_n * BN + tl.arange(0, BN)
        col_mask = cols < N
        scale_rows = tl.where(cols < split, cols // BK, split_blocks + (cols - split) // BK)
        w_base = w_ptr + expert * stride_we
        s_base = scale_ptr + expert * stride_se + scale_rows * stride_sn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for tile in range(0, tl.cdiv(K, BK)):
            ks = tile * BK + tl.arange(0, BK)
            k_mask = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], valid[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            bits = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], w_mask, other=0)  # [BK, BN]
            if FP8_NATIVE:
                w = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                w = decode_e4m3_(bits)
            scale = tl.load(s_base + tile, mask=col_mask, other=0.0)
            w = tl.where(w_mask, w * scale[None, :], 0.0)  # keep NaN · 0 of masked bytes out of the sums
            if DOT_IN_X_DTYPE:  # bfloat16 / float16 tensor cores on GPU
                acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
            else:
                acc = tl.dot(x.to(tl.float32), w, acc)
        mask = valid[:, None] & col_mask[None, :]
        tl.store(out_ptr + slots[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(weight: torch.Tensor, scale: torch.Tensor, split: int) -> None:
    """ValueError naming what does not fit: uint8 [E, N, K] weights, float32 [E, blocks(N, split), ⌈K/128⌉] scales."""
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        raise ValueError(f"weight must be uint8 [E, N, K] (e4m3 bytes), got {weight.dtype} {tuple(weight.shape)}")
    num_experts, num_out, num_in = weight.shape
    expected = (num_experts, split_scale_rows(num_out, min(split, num_out)), triton.cdiv(num_in, FP8_BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(f"scale must be float32 {expected}, got {scale.dtype} {tuple(scale.shape)}")


@torch.library.custom_op("hybridgen::moe_fp8_grouped_gemm", mutates_args=())
def grouped_gemm(
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_expert: torch.Tensor,
    split: int,
) -> torch.Tensor:
    """out [slots, N] = x[rows[s]] · dequantize(weight[e(s)], scale[e(s)])ᵀ per padded slot s (zeros where
    rows[s] = -1); weight uint8 [E, N, K], its row blocks restarting at `split`."""
    _check(weight, scale, split)
    num_slots, (num_experts, n, k) = rows.shape[0], weight.shape
    split = min(split, n)
    out = torch.zeros(num_slots, n, dtype=x.dtype, device=x.device)
    grid = (num_slots // BLOCK_M, triton.cdiv(n, BLOCK_N))
    _fp8_grouped_gemm_kernel[grid](
        x,
        rows,
        weight,
        scale,
        block_expert,
        out,
        n,
        k,
        split,
        triton.cdiv(split, FP8_BLOCK),
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        num_experts,
        FP8_NATIVE=native_fp8(x.device),
        # The interpreter's tl.dot mis-multiplies bfloat16 (numpy has none), so there it multiplies in float32.
        DOT_IN_X_DTYPE=x.dtype != torch.float32 and not interpreter_on(),
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=FP8_BLOCK,
    )
    return out


@grouped_gemm.register_fake
def _(
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_expert: torch.Tensor,
    split: int,
) -> torch.Tensor:
    return x.new_empty(rows.shape[0], weight.shape[1])


def fp8_expert_rows(
    x: torch.Tensor,
    ids: torch.Tensor,
    up: tuple[torch.Tensor, torch.Tensor, int],
    down: tuple[torch.Tensor, torch.Tensor],
    gated: bool,
    activate: Callable[[torch.Tensor, bool], torch.Tensor],
) -> torch.Tensor:
    """Each (token, slot) pair's expert output [t · k, w] for x [t, w] and expert ids [t, k]: `up` (uint8
    [E, rows, w], scales, split row), `down` (uint8 [E, w, I], scales), as `layers/fp8_experts.py`'s reference."""
    k = ids.shape[1]
    # An id of E (expert parallel: another rank's expert) is aligned as one more expert, whose blocks the kernel
    # skips (it multiplies only experts below E): zeros, no GEMM work.
    pair_of_slot, slot_of_pair, block_expert = align(ids.reshape(-1), up[0].shape[0] + 1)
    token_rows = torch.where(pair_of_slot >= 0, pair_of_slot // k, -1)
    h = activate(grouped_gemm(x.contiguous(), token_rows, *up[:2], block_expert, up[2]), gated)
    slot_rows = torch.where(pair_of_slot >= 0, torch.arange(pair_of_slot.shape[0], device=x.device), -1)
    out = grouped_gemm(h.contiguous(), slot_rows, *down, block_expert, down[0].shape[1])
    return out[slot_of_pair]
