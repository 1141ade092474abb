"""x · Wᵀ with W kept as block-wise FP8 (e4m3 bytes + one float32 `scale_inv` per 128 × 128 block).

Each program computes a [BLOCK_M, BLOCK_N] tile of the output: per K tile of 128 it loads the weight bytes, decodes
them to float32 (a bitcast to `tl.float8e4nv` where the GPU converts FP8, else the bit formula below, which the
interpreter and older GPUs run), multiplies by the tile's block scales and accumulates `tl.dot` in float32. So the
weight stays one byte per parameter in memory and is dequantized only one tile at a time, inside the kernel.

`dequantize_fp8_blocks` is the PyTorch reference (and the CPU path of `layers/fp8_linear.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.model.kernels.fp8 import FP8_BLOCK
from workers.model.kernels.triton_kernels import interpreter_on

BLOCK_M = 16
BLOCK_N = 64  # divides FP8_BLOCK; each output column still reads its own block row's scale


@triton.jit
def decode_e4m3_(bits):
    """float32 values of e4m3fn bytes (uint8): sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is
    subnormal (m · 2⁻⁹), 0x7F / 0xFF are NaN, there is no infinity."""
    bits = bits.to(tl.int32)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(tl.float32)
    normal = (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32))
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125, normal)  # 2⁻⁹
    magnitude = tl.where((bits & 0x7F) == 0x7F, float("nan"), magnitude)
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride,
    scale_ptr,
    scale_stride,
    bias_ptr,
    out_ptr,
    out_stride,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_IN_X_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = Σ_k x[m, k] · decode(w[n, k]) · scale_inv[n // BLOCK_K, k // BLOCK_K] (+ bias[n])."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        bits = tl.load(w_ptr + cols[None, :] * w_stride + ks[:, None], w_mask, other=0)  # [BLOCK_K, BLOCK_N]
        if FP8_NATIVE:
            w = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = decode_e4m3_(bits)
        scale = tl.load(scale_ptr + (cols // BLOCK_K) * scale_stride + tile, mask=col_mask, other=0.0)
        w = tl.where(w_mask, w * scale[None, :], 0.0)  # masked bytes decode to 0, but keep NaN·0 out of the sums
        if DOT_IN_X_DTYPE:  # bfloat16 / float16 tensor cores on GPU
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        else:
            acc = tl.dot(x.to(tl.float32), w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """ValueError naming the argument whose shape or dtype does not fit."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"weight must be uint8 [N, K] (e4m3 bytes), got {weight.dtype} {tuple(weight.shape)}")
    num_out, num_in = weight.shape
    expected = (triton.cdiv(num_out, FP8_BLOCK), triton.cdiv(num_in, FP8_BLOCK))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv must be float32 {expected}, got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if x.dim() != 2 or x.shape[1] != num_in:
        raise ValueError(f"x must be [M, {num_in}], got {tuple(x.shape)}")


def native_fp8(device: torch.device) -> bool:
    """Whether the kernel decodes by bitcasting to `tl.float8e4nv` (CUDA with compute capability ≥ 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16 / float16) · dequantize(weight [N, K] uint8, scale_inv)ᵀ (+ bias) → [M, N] in
    x's dtype; float32 accumulation (float32 x uses the GPU's default `tl.dot` precision, TF32 on Ampere+)."""
    _check(x, weight, scale_inv)
    x, weight, scale_inv = x.contiguous(), weight.contiguous(), scale_inv.contiguous()
    num_rows, (num_out, num_in) = x.shape[0], weight.shape
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_out == 0:
        return out
    # The interpreter's tl.dot mis-multiplies bfloat16 (numpy has none), so there it multiplies in float32.
    low_precision_dot = x.dtype != torch.float32 and not interpreter_on()
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(num_out, BLOCK_N))
    _fp8_block_linear_kernel[grid](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        scale_inv,
        scale_inv.stride(0),
        bias if bias is not None else out,
        out,
        out.stride(0),
        num_rows,
        num_out,
        num_in,
        HAS_BIAS=bias is not None,
        FP8_NATIVE=native_fp8(x.device),
        DOT_IN_X_DTYPE=low_precision_dot,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=FP8_BLOCK,
    )
    return out
