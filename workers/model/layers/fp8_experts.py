"""MoE experts whose weights stay block-wise FP8 in memory (`quantization="fp8"`): one byte per weight plus one
float32 scale per 128 × 128 block, where experts are most of a MoE model's bytes.

On the meta device (nothing allocated yet) the loader hands each MoE whose experts come from FP8 tensors an
`Fp8Experts` (`MoE.fp8_experts`) in place of its float `experts_up` / `experts_down`, then reads the checkpoint's
bytes and scales into it expert by expert. The layouts read: the fused `experts.gate_up_proj [E, 2I, W]` /
`experts.down_proj [E, W, I]` (or Granite's `input_linear` / `output_linear`) with their `[E, ⌈rows/128⌉, ⌈W/128⌉]`
scales, per-expert matrices stacked, and per-expert gate and up matrices stacked gate rows first: those were
quantized apart, so their scales stay apart (`up_split`: the row where the up rows' blocks start), and no block
mixes two scales when I is not a multiple of 128. A rank under tensor or expert parallelism keeps the cut its MoE's
`shard_rules()` states when it falls on whole blocks (`fp8_expert_reads.py`). Other layouts and cuts load
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

from workers.model.distributed.slices import REPLICATED, qualified_rules
from workers.model.kernels import triton_kernels
from workers.model.kernels.fp8 import dequantize_fp8_blocks, dequantize_split_blocks, split_scale_rows
from workers.model.layers.feed_forward import activate
from workers.model.layers.fp8_expert_reads import ExpertRead, blocks, plan_read, read_experts, stacks_pairs
from workers.model.layers.fp8_linear import Fp8BlockLinear
from workers.model.layers.moe import MoE

logger = logging.getLogger(__name__)

FP8_EXPERTS_GRAPH_REASON = "MoE experts kept in FP8 (quantization='fp8') are not captured in CUDA graphs yet"


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
        self.register_buffer("up_scale", torch.empty(num_experts, up_blocks, blocks(width)))
        self.register_buffer("down", torch.empty(num_experts, width, inner, dtype=torch.uint8))
        self.register_buffer("down_scale", torch.empty(num_experts, blocks(width), blocks(inner)))
        self.reads: tuple[ExpertRead, ExpertRead] | None = None  # where the loader reads the bytes (set on meta)

    def expert(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `index`'s (up [rows, W], down [W, I]) dequantized to float32."""
        up = dequantize_split_blocks(self.up[index], self.up_scale[index], self.up_split)
        return up, dequantize_fp8_blocks(self.down[index], self.down_scale[index])

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [t, W], expert ids [t, k] → each (token, slot) pair's expert output [t · k, W] in x's dtype; zeros for
        an id of E, the experts held here (expert parallel: another rank's expert, as `moe._rows_static` takes it)."""
        if x.is_cuda and triton_kernels.available(x.device):
            from workers.model.kernels.triton_kernels.fp8_moe import fp8_expert_rows  # imports triton

            up, down = (self.up, self.up_scale, self.up_split), (self.down, self.down_scale)
            return fp8_expert_rows(x, ids, up, down, self.gated, activate)
        return self.reference_rows(x, ids)

    def reference_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`forward` in PyTorch: one used expert dequantized at a time (never all experts in float). An id of E
        (expert parallel: another rank's expert) gives zeros."""
        k, flat, num_experts = ids.shape[1], ids.reshape(-1), self.up.shape[0]
        out = x.new_zeros(flat.shape[0], self.down.shape[1])
        for index in flat.unique().tolist():
            if index >= num_experts:
                continue
            pairs = (flat == index).nonzero().squeeze(1)
            up, down = (w.to(x.dtype) for w in self.expert(index))
            out[pairs] = F.linear(activate(F.linear(x[pairs // k], up), self.gated), down)
        return out

    def extra_repr(self) -> str:
        (num_experts, up_rows, width), inner = self.up.shape, self.down.shape[2]
        return f"experts={num_experts}, up_rows={up_rows}, width={width}, inner={inner}, up_split={self.up_split}"


def _reads(name: str, moe: MoE, plan: dict[str, Any], rules: dict, tensors: Any) -> tuple[ExpertRead, ...] | str:
    """How the MoE `name` reads its up and down experts in FP8 on this rank, or why it cannot."""
    up, down = plan.get(f"{name}.experts_up"), plan.get(f"{name}.experts_down")
    if up is None or down is None:
        return "no checkpoint source"
    num_experts = moe.router.ff.num_experts  # global: a rank's experts are a cut of them
    pairs = len(up.keys) == 2 * num_experts and up.transform is not None
    if pairs and not (moe.gated and stacks_pairs(up.transform, num_experts)):
        return "its per-expert tensors are not gate and up stacked gate rows first"
    if (up.transform is not None and not pairs) or down.transform is not None:
        return "its checkpoint tensors are transformed as they load"
    sources = {"experts_up": up, "experts_down": down}
    reads = [plan_read(s.keys, num_experts, tensors, rules.get(f"{name}.{p}", REPLICATED)) for p, s in sources.items()]
    why = next((r for r in reads if isinstance(r, str)), None)
    if why is not None:
        return why
    if (reads[0].shape, reads[1].shape) != (tuple(moe.experts_up.shape), tuple(moe.experts_down.shape)):
        return "its checkpoint tensors, cut for this rank, do not have the model's expert shapes"
    return tuple(reads)  # type: ignore[arg-type]


def keep_fp8_experts(model: nn.Module, plan: dict[str, Any], tensors: Any) -> dict[str, tuple[str, ...]]:
    """On the model still on the meta device: give each MoE whose experts the checkpoint stores in block-wise FP8 an
    empty `Fp8Experts` in place of its float experts, cut for this rank by the MoE's `shard_rules()` where it states
    them (`plan`: parameter name → `checkpoint.weights.Source`; `tensors`: the `CheckpointTensors`). Returns the
    `experts_up` / `experts_down` names → their checkpoint keys (which the loader then skips); experts it cannot keep
    load dequantized, with a log line saying why."""
    rules = qualified_rules(model)
    kept: dict[str, tuple[str, ...]] = {}
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE) or moe.packed is not None or getattr(moe, "experts_up", None) is None:
            continue
        reads = _reads(name, moe, plan, rules, tensors)
        if isinstance(reads, str):
            logger.info("quantization='fp8': the experts of %s load dequantized: %s", name, reads)
            continue
        (num_experts, up_rows, width), inner = reads[0].shape, reads[1].shape[2]
        with torch.device("meta"):
            moe.fp8_experts = Fp8Experts(num_experts, up_rows, width, inner, moe.gated, reads[0].split)
        moe.fp8_experts.reads = reads
        del moe.experts_up, moe.experts_down
        kept[f"{name}.experts_up"], kept[f"{name}.experts_down"] = reads[0].keys, reads[1].keys
    return kept


def fill_fp8_experts(model: nn.Module, tensors: Any) -> None:
    """Read each `Fp8Experts`' bytes and scales from the checkpoint (as `keep_fp8_experts` planned) into its
    buffers on their device (the scales back to float32, which the model's `.to(dtype)` changed), then log how many
    bytes stay FP8 (`fp8_summary`) when any do."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Fp8Experts) and module.reads is not None:
                module.up_scale, module.down_scale = module.up_scale.float(), module.down_scale.float()
                read_experts(module.reads[0], module.up, module.up_scale, tensors)
                read_experts(module.reads[1], module.down, module.down_scale, tensors)
                module.reads = None
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
