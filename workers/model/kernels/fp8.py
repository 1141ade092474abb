"""Block-wise FP8 weights in PyTorch: the reference for `triton_kernels/fp8_gemm.py` and `fp8_moe.py`, and the CPU
path of `layers/fp8_linear.py` and `layers/fp8_experts.py`."""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # the block size of `weight_scale_inv` in the published block-wise FP8 checkpoints


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float32 [N, K] = e4m3(weight [N, K] uint8 bytes) · scale_inv [⌈N/block⌉, ⌈K/block⌉] per block (the last
    blocks cut at the edges); bytes decoded by torch's float8_e4m3fn."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"weight must be uint8 [N, K] (e4m3 bytes), got {weight.dtype} {tuple(weight.shape)}")
    num_out, num_in = weight.shape
    expected = (-(-num_out // block), -(-num_in // block))
    if tuple(scale_inv.shape) != expected:
        shapes = f"{tuple(scale_inv.shape)}, expected {expected} for a {tuple(weight.shape)} weight"
        raise ValueError(f"scale_inv has shape {shapes} in {block} × {block} blocks")
    full = scale_inv.float().repeat_interleave(block, 0)[:num_out].repeat_interleave(block, 1)[:, :num_in]
    return weight.view(torch.float8_e4m3fn).float().mul_(full)


def split_scale_rows(num_rows: int, split: int, block: int = FP8_BLOCK) -> int:
    """Scale rows of a weight whose row blocks restart at row `split` (see `dequantize_split_blocks`)."""
    return -(-split // block) + -(-(num_rows - split) // block)


def dequantize_split_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, split: int, block: int = FP8_BLOCK
) -> torch.Tensor:
    """float32 [N, K] of a weight stacked from two FP8 tensors quantized apart (an expert's gate rows [0, split),
    then its up rows): rows before `split` take the first ⌈split/block⌉ scale rows, the rest the others. When `split`
    is not a multiple of `block` one stored block of each part is cut short, so no block mixes the two parts' scales.
    `split` ≥ N: one tensor (`dequantize_fp8_blocks`)."""
    if split >= weight.shape[0]:
        return dequantize_fp8_blocks(weight, scale_inv, block)
    first = -(-split // block)
    head = dequantize_fp8_blocks(weight[:split], scale_inv[:first], block)
    return torch.cat([head, dequantize_fp8_blocks(weight[split:], scale_inv[first:], block)])
