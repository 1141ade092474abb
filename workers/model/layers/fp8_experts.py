"""MoE experts whose weights stay block-wise FP8 in memory (`quantization="fp8"`): one byte per weight plus one
float32 scale per 128 × 128 block, where experts are most of a MoE model's bytes.

On the meta device (nothing allocated yet) the loader hands each MoE whose experts come from FP8 tensors an
`Fp8Experts` (`MoE.fp8_experts`) in place of its float `experts_up` / `experts_down`, then reads the checkpoint's
bytes and scales into it expert by expert. The layouts read: the fused `experts.gate_up_proj [E, 2I, W]` /
`experts.down_proj [E, W, I]` (or Granite's `input_linear` / `output_linear`) with their `[E, ⌈rows/128⌉, ⌈W/128⌉]`
scales, per-expert matrices stacked, and per-expert gate and up matrices stacked gate rows first: those were
quantized apart, so their scales stay apart (`up_split`: the row where the up rows' blocks start), and no block
mixes two scales when I is not a multiple of 128. Other layouts, and experts sliced for tensor parallelism, load
dequantized as before, with a log line.

Compute: CUDA (where Triton runs) a grouped GEMM over the routed pairs that decodes each tile inside the kernel
(`kernels/triton_kernels/fp8_moe.py`); elsewhere one used expert at a time is dequantized to float and multiplied
as `layers/moe._rows_eager` multiplies the float experts (the same float32 weights, so the same results).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.kernels import triton_kernels
from workers.model.kernels.fp8 import FP8_BLOCK, dequantize_fp8_blocks, dequantize_split_blocks, split_scale_rows
from workers.model.layers.feed_forward import activate
from workers.model.layers.fp8_linear import Fp8BlockLinear
from workers.model.layers.moe import MoE

logger = logging.getLogger(__name__)

FP8_EXPERTS_GRAPH_REASON = "MoE experts kept in FP8 (quantization='fp8') are not captured in CUDA graphs yet"


def _blocks(size: int) -> int:
    return -(-size // FP8_BLOCK)


class Fp8Experts(nn.Module):
    """A MoE's routed experts as e4m3 bytes: `up` uint8 [E, rows, W] (gate rows then up rows when gated), `down`
    uint8 [E, W, I], and float32 block scales `up_scale` [E, blocks(rows, up_split), ⌈W/128⌉], `down_scale`
    [E, ⌈W/128⌉, ⌈I/128⌉]."""

    def __init__(self, num_experts: int, up_rows: int, width: int, inner: int, gated: bool, up_split: int):
        super().__init__()
        if not 0 < up_split <= up_rows:
            raise ValueError(f"up_split={up_split} must lie in 1 … {up_rows} (the up projection's rows)")
        self.gated, self.up_split = gated, up_split
        up_blocks = split_scale_rows(up_rows, up_split)
        self.register_buffer("up", torch.empty(num_experts, up_rows, width, dtype=torch.uint8))
        self.register_buffer("up_scale", torch.empty(num_experts, up_blocks, _blocks(width)))
        self.register_buffer("down", torch.empty(num_experts, width, inner, dtype=torch.uint8))
        self.register_buffer("down_scale", torch.empty(num_experts, _blocks(width), _blocks(inner)))

    def expert(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `index`'s (up [rows, W], down [W, I]) dequantized to float32."""
        up = dequantize_split_blocks(self.up[index], self.up_scale[index], self.up_split)
        return up, dequantize_fp8_blocks(self.down[index], self.down_scale[index])

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [t, W], expert ids [t, k] → each (token, slot) pair's expert output [t · k, W] in x's dtype."""
        if x.is_cuda and triton_kernels.available(x.device):
            from workers.model.kernels.triton_kernels.fp8_moe import fp8_expert_rows  # imports triton

            up, down = (self.up, self.up_scale, self.up_split), (self.down, self.down_scale)
            return fp8_expert_rows(x, ids, up, down, self.gated, activate)
        return self.reference_rows(x, ids)

    def reference_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`forward` in PyTorch: one used expert dequantized at a time (never all experts in float)."""
        k, flat = ids.shape[1], ids.reshape(-1)
        out = x.new_empty(flat.shape[0], self.down.shape[1])
        for index in flat.unique().tolist():
            pairs = (flat == index).nonzero().squeeze(1)
            up, down = (w.to(x.dtype) for w in self.expert(index))
            out[pairs] = F.linear(activate(F.linear(x[pairs // k], up), self.gated), down)
        return out

    def extra_repr(self) -> str:
        (num_experts, up_rows, width), inner = self.up.shape, self.down.shape[2]
        return f"experts={num_experts}, up_rows={up_rows}, width={width}, inner={inner}, up_split={self.up_split}"


def _stacks_pairs(transform: Any, num_experts: int) -> bool:
    """Whether `transform` stacks [gate_0, up_0, gate_1, up_1, …] into [E, gate rows then up rows, …]: tried on
    one-element stand-ins numbered by position."""
    stand_ins = [torch.full((1, 1), float(i)) for i in range(2 * num_experts)]
    try:
        stacked = transform(stand_ins)
    except Exception:  # a transform written for other shapes: not a plain stacking, so not kept
        return False
    return torch.equal(stacked, torch.arange(2.0 * num_experts).view(num_experts, 2, 1))


def _layout(source: Any, shape: tuple[int, ...], gated: bool, tensors: Any) -> tuple[int, str | None]:
    """(up_split, None) when the parameter of `shape` [E, rows, cols] reads `source` as FP8 bytes, else (0, why)."""
    num_experts, rows, cols = shape
    keys = source.keys
    if not keys or not all(tensors.is_fp8(key) for key in keys):
        return 0, "not every expert tensor is block-wise FP8"
    found = {tuple(tensors.shapes[key]) for key in keys}
    if len(keys) == 1 and source.transform is None and found == {shape}:
        return rows, None  # fused [E, rows, cols]
    if source.combine == "stack" and source.transform is None and len(keys) == num_experts and found == {shape[1:]}:
        return rows, None
    pairs = gated and len(keys) == 2 * num_experts and rows % 2 == 0 and found == {(rows // 2, cols)}
    if pairs and source.transform is not None and _stacks_pairs(source.transform, num_experts):
        return rows // 2, None
    return 0, f"the layout {keys[0]!r}, … ({len(keys)} tensors) is not one the FP8 experts read"


def keep_fp8_experts(model: nn.Module, plan: dict[str, Any], tensors: Any) -> dict[str, tuple[str, ...]]:
    """On the model still on the meta device: give each MoE whose experts the checkpoint stores in block-wise FP8 an
    empty `Fp8Experts` in place of its float experts (`plan`: parameter name → `checkpoint.weights.Source`;
    `tensors`: the `CheckpointTensors`). Returns `experts_up` / `experts_down` names → their checkpoint keys, which
    `fill_fp8_experts` reads; experts it cannot keep load dequantized, with a log line saying why."""
    tp = getattr(model, "tp", None)
    kept: dict[str, tuple[str, ...]] = {}
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE) or moe.packed is not None or getattr(moe, "experts_up", None) is None:
            continue
        up, down = plan.get(f"{name}.experts_up"), plan.get(f"{name}.experts_down")
        split, why = _layout(up, tuple(moe.experts_up.shape), moe.gated, tensors) if up else (0, "no source")
        if why is None:
            why = _layout(down, tuple(moe.experts_down.shape), False, tensors)[1] if down else "no source"
        if tp is not None and tp.size > 1:
            why = "FP8 experts are not sliced for tensor parallelism yet"
        if why is not None:
            logger.info("quantization='fp8': the experts of %s load dequantized: %s", name, why)
            continue
        (num_experts, up_rows, width), inner = moe.experts_up.shape, moe.experts_down.shape[2]
        with torch.device("meta"):
            moe.fp8_experts = Fp8Experts(num_experts, up_rows, width, inner, moe.gated, split)
        del moe.experts_up, moe.experts_down
        kept[f"{name}.experts_up"], kept[f"{name}.experts_down"] = up.keys, down.keys
    return kept


def _fill(weight: torch.Tensor, scale: torch.Tensor, keys: tuple[str, ...], tensors: Any) -> None:
    """Read `keys` (one fused [E, …] tensor, or E · p tensors: p parts per expert stacked along its rows) into the
    uint8 `weight` [E, rows, cols] and float32 `scale`, one checkpoint tensor at a time."""
    if len(keys) == 1:
        _stack_rows(weight, scale, [tensors.read_fp8(keys[0])], keys[0])
        return
    per_expert = len(keys) // weight.shape[0]
    for e in range(weight.shape[0]):
        own = keys[e * per_expert : (e + 1) * per_expert]
        _stack_rows(weight[e], scale[e], (tensors.read_fp8(key) for key in own), own[0])


def _stack_rows(weight: torch.Tensor, scale: torch.Tensor, parts: Any, key: str) -> None:
    """Copy (bytes, scales) `parts` one after the other along the rows of `weight` and of `scale`."""
    row = block = 0
    for bytes_, blocks in parts:
        rows, num_blocks = bytes_.shape[-2], blocks.shape[-2]
        expected = (*bytes_.shape[:-2], _blocks(rows), _blocks(bytes_.shape[-1]))
        if tuple(blocks.shape) != expected:
            shapes = f"{tuple(blocks.shape)}, not the 128 × 128 block scales {expected}"
            raise ValueError(f"{key}_scale_inv has shape {shapes} of a {tuple(bytes_.shape)} weight")
        weight.narrow(-2, row, rows).copy_(bytes_)
        scale.narrow(-2, block, num_blocks).copy_(blocks)
        row, block = row + rows, block + num_blocks


def fill_fp8_experts(model: nn.Module, kept: dict[str, tuple[str, ...]], tensors: Any) -> None:
    """Read each `Fp8Experts`' bytes and scales from the checkpoint (`kept`, from `keep_fp8_experts`) into its
    buffers on their device (the scales back to float32, which the model's `.to(dtype)` changed), then log how many
    bytes stay FP8 (`fp8_summary`) when any do."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Fp8Experts):
                moe = name.rpartition(".")[0]
                module.up_scale, module.down_scale = module.up_scale.float(), module.down_scale.float()
                _fill(module.up, module.up_scale, kept[f"{moe}.experts_up"], tensors)
                _fill(module.down, module.down_scale, kept[f"{moe}.experts_down"], tensors)
    if any(isinstance(m, (Fp8BlockLinear, Fp8Experts)) for m in model.modules()):
        logger.info("quantization='fp8': %s", fp8_summary(model))


def fp8_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held in FP8: "linears" and "experts" (the e4m3 weights, one byte each) and "scales" (their float32
    block scales)."""
    counts = {"linears": 0, "experts": 0, "scales": 0}
    for module in model.modules():
        if isinstance(module, Fp8BlockLinear):
            counts["linears"] += module.weight.numel()
            counts["scales"] += module.scale_inv.numel() * module.scale_inv.element_size()
        elif isinstance(module, Fp8Experts):
            counts["experts"] += module.up.numel() + module.down.numel()
            counts["scales"] += sum(s.numel() * s.element_size() for s in (module.up_scale, module.down_scale))
    return counts


def fp8_summary(model: nn.Module) -> str:
    """One line: the bytes kept in FP8 (linears, MoE experts), their scales, and what stayed in float."""
    counts, mib = fp8_bytes(model), 2**20
    kept = counts["linears"] + counts["experts"]
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    other = sum(t.numel() * t.element_size() for t in tensors) - kept - counts["scales"]
    return (
        f"{kept / mib:.1f} MiB of weights kept in FP8 (linears {counts['linears'] / mib:.1f} MiB, MoE experts "
        f"{counts['experts'] / mib:.1f} MiB) + {counts['scales'] / mib:.1f} MiB of block scales; "
        f"{other / mib:.1f} MiB of other weights"
    )
