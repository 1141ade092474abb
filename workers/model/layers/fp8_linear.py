"""Linears whose weights stay block-wise FP8 in memory (`quantization="fp8"`): one byte per weight plus one float32
scale per 128 × 128 block, half the bytes of bfloat16.

Before the model is materialized (on the meta device, so no float copy is ever allocated), the loader replaces each
`nn.Linear` whose weight comes from FP8 tensors (one, or several concatenated along the outputs at 128-row block
boundaries) by an `Fp8BlockLinear`, then reads those bytes and scales into it. MoE experts stay FP8 in
`layers/fp8_experts.py`. Other assembled weights (a fused projection cut inside a block, a transform) and the modules
the checkpoint left unconverted load as before (dequantized).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.model.kernels import triton_kernels
from workers.model.kernels.fp8 import FP8_BLOCK, dequantize_fp8_blocks

KEEP_FP8 = "fp8"  # the `quantization` that keeps a block-wise FP8 checkpoint's linears in FP8 (vLLM's name)
FP8_KEPT_REASON = "weights kept in FP8 (quantization='fp8': linears, MoE experts) have no native CPU kernel"


class Fp8BlockLinear(nn.Module):
    """y = x · (e4m3(weight) · scale_inv per block)ᵀ (+ bias). CUDA: the Triton kernel dequantizes one K tile at a
    time (`triton_kernels/fp8_gemm.py`); elsewhere the PyTorch reference dequantizes the whole weight per call
    (correct, not fast)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.uint8 and weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8BlockLinear needs e4m3 weights (uint8 bytes), got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.view(torch.uint8))  # [N, K] e4m3 bytes
        self.register_buffer("scale_inv", scale_inv.float())  # [⌈N/128⌉, ⌈K/128⌉]
        # [N] or None: a parameter, so that the loader fills it from the checkpoint as a Linear's bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        expected = (-(-self.out_features // FP8_BLOCK), -(-self.in_features // FP8_BLOCK))
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, expected {expected}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out], in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if x.device.type == "cuda" and triton_kernels.available(x.device):
            from workers.model.kernels.triton_kernels.fp8_gemm import fp8_block_linear

            out = fp8_block_linear(rows, self.weight, self.scale_inv, self.bias)
        else:
            weight = dequantize_fp8_blocks(self.weight, self.scale_inv).to(x.dtype)
            out = nn.functional.linear(rows, weight, None if self.bias is None else self.bias.to(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def fp8_kept_sources(plan: dict[str, Any], tensors: Any) -> dict[str, tuple[str, ...]]:
    """Parameter name → its checkpoint keys, for the `.weight`s that stay FP8: read from one FP8 tensor as it is, or
    concatenated along the outputs from FP8 tensors whose rows (all but the last's) fill whole 128-row blocks, so
    their bytes and scales concatenate as they are (`plan`: parameter name → `checkpoint.weights.Source`;
    `tensors`: the checkpoint's `CheckpointTensors`, for `shapes` and `is_fp8`)."""
    kept = {}
    for name, source in plan.items():
        keys = source.keys
        plain = source.transform is None and (source.combine == "cat" or (source.combine == "one" and len(keys) == 1))
        aligned = all(tensors.shapes[key][0] % FP8_BLOCK == 0 for key in keys[:-1])
        if name.endswith(".weight") and plain and aligned and all(tensors.is_fp8(key) for key in keys):
            kept[name] = tuple(keys)
    return kept


def read_kept(keys: tuple[str, ...], tensors: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 weight, scale_inv) of `keys` concatenated along the outputs (`fp8_kept_sources` checked alignment)."""
    parts = [tensors.read_fp8(key) for key in keys]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([weight for weight, _ in parts]), torch.cat([scale for _, scale in parts])


def keep_fp8_linears(model: nn.Module, kept: dict[str, tuple[str, ...]], tensors: Any) -> int:
    """On the model still on the meta device (nothing allocated): replace each `nn.Linear` whose weight is in `kept`
    by an empty `Fp8BlockLinear` of its shape (its bias stays a parameter, loaded as before); a Linear shared by
    several parents is replaced once. `fill_fp8_linears` reads the bytes once the model is on its device. Returns
    how many were replaced."""
    replaced: dict[int, Fp8BlockLinear] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            keys = kept.get(".".join(p for p in (parent_name, name, "weight") if p))
            if keys is not None and id(child) not in replaced:
                num_out = sum(tensors.shapes[key][0] for key in keys)
                blocks = (-(-num_out // FP8_BLOCK), -(-child.in_features // FP8_BLOCK))
                weight = torch.empty(num_out, child.in_features, dtype=torch.uint8, device="meta")
                scale_inv = torch.empty(blocks, device="meta")
                replaced[id(child)] = Fp8BlockLinear(weight, scale_inv, child.bias)
            if id(child) in replaced:
                setattr(parent, name, replaced[id(child)])
    return len(replaced)


def fill_fp8_linears(model: nn.Module, kept: dict[str, tuple[str, ...]], tensors: Any) -> None:
    """Read each `Fp8BlockLinear`'s bytes and scales from the checkpoint (`kept`: its weight's name → keys) into the
    buffers on its device (the scales back to float32, which the model's `.to(dtype)` changed)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Fp8BlockLinear):
                weight, scale_inv = read_kept(kept[f"{name}.weight"], tensors)
                assert tuple(weight.shape) == (module.out_features, module.in_features), name  # match_weights checked
                module.weight.copy_(weight)
                module.scale_inv = scale_inv.to(module.weight.device)


def check_fp8_checkpoint(block: tuple[int, int] | None, num_kept: int, directory: Any) -> None:
    """`ValueError` naming the checkpoint unless `quantization="fp8"` can keep its weights: block-wise FP8
    (`block` from config.json's quantization_config) in 128 × 128 blocks, with at least one linear to keep."""
    if block is None:
        raise ValueError(
            f"quantization='fp8' keeps a block-wise FP8 checkpoint's weights in FP8, but {directory} is not one "
            "(its config.json has no quantization_config with quant_method 'fp8'); load it with quantization None"
        )
    if tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(
            f"quantization='fp8' needs {FP8_BLOCK} × {FP8_BLOCK} weight blocks, but {directory} uses {block[0]} × "
            f"{block[1]}; load it with quantization None (dequantized)"
        )
    if num_kept == 0:
        raise ValueError(f"quantization='fp8': no linear of {directory} is stored as a single block-wise FP8 weight")
