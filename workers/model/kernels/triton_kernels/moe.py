"""The experts of a MoE step as one Triton grouped GEMM, for GPUs where `torch._grouped_mm` does not run (before
compute capability 8.0, or float16 / float32 models): vLLM's `fused_moe` layout.

The (token, slot) pairs are sorted by expert on the device, and each expert's rows are padded to `BLOCK_M`, so every
block of `BLOCK_M` sorted rows belongs to one expert. The number of blocks is fixed by the shapes alone: pairs +
experts · (BLOCK_M − 1), rounded up. The kernel multiplies each block by its expert's weight; padding rows read
zeros and are never written back. No host sync and no data-dependent shape, so a CUDA graph captures it; the capture
check sees `hybridgen::moe_grouped_gemm` through its fake (shape-only) implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    rows_ptr,
    w_ptr,
    block_expert_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    num_experts,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """out[s] = x[rows[s]] · w[e]ᵀ for the sorted slots s of block `pid_m` (expert e); rows[s] = -1: padding."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:
        slots = pid_m * BM + tl.arange(0, BM)
        rows = tl.load(rows_ptr + slots)
        valid = rows >= 0
        n = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0
            )
            b = tl.load(
                w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk,
                mask=(n[None, :] < N) & (k[:, None] < K),
                other=0.0,
            )
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        mask = valid[:, None] & (n[None, :] < N)
        tl.store(out_ptr + slots[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def align(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [pairs] → (pair of each padded slot [slots] (-1: padding), slot of each pair [pairs], expert of
    each block [slots / BLOCK_M] (num_experts: an unused block)), all in static shapes."""
    pairs, device = flat_ids.shape[0], flat_ids.device
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids)
    )
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = padded.cumsum(0)
    sorted_experts = flat_ids[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    slot_of_sorted = (padded_ends - padded)[sorted_experts] + rank
    num_slots = -(-(pairs + num_experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    pair_of_slot = torch.full((num_slots,), -1, dtype=torch.int64, device=device).scatter_(0, slot_of_sorted, order)
    slot_of_pair = torch.empty_like(order).scatter_(0, order, slot_of_sorted)
    block_starts = torch.arange(0, num_slots, BLOCK_M, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    return pair_of_slot, slot_of_pair, block_expert


@torch.library.custom_op("hybridgen::moe_grouped_gemm", mutates_args=())
def grouped_gemm(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
    """out [slots, N] = x[rows[s]] · weight[e(s)]ᵀ per padded slot s (zeros where rows[s] = -1); weight [E, N, K]."""
    num_slots, (num_experts, n, k) = rows.shape[0], weight.shape
    out = torch.zeros(num_slots, n, dtype=x.dtype, device=x.device)
    grid = (num_slots // BLOCK_M, triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        x,
        rows,
        weight,
        block_expert,
        out,
        n,
        k,
        x.stride(0),
        *weight.stride(),
        out.stride(0),
        num_experts,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return out


@grouped_gemm.register_fake
def _(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
    return x.new_empty(rows.shape[0], weight.shape[1])


def expert_rows(
    x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gated: bool, activate
) -> torch.Tensor:
    """Each (token, slot) pair's expert output [t · k, w], as `layers/moe._rows_eager` computes it. An id of E
    (the experts held here; expert parallel: another rank's expert) gives zeros: it is aligned as one more expert,
    whose blocks the kernel skips (it multiplies only experts below E)."""
    k = ids.shape[1]
    pair_of_slot, slot_of_pair, block_expert = align(ids.reshape(-1), up.shape[0] + 1)
    token_rows = torch.where(pair_of_slot >= 0, pair_of_slot // k, -1)
    h = activate(grouped_gemm(x.contiguous(), token_rows, up, block_expert), gated)
    slot_rows = torch.where(pair_of_slot >= 0, torch.arange(pair_of_slot.shape[0], device=x.device), -1)
    return grouped_gemm(h.contiguous(), slot_rows, down, block_expert)[slot_of_pair]
