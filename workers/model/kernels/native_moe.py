"""Mixture-of-experts through the native kernels (`csrc/moe.c`): experts packed at load, routing and experts in C.

Each expert's up ([gate; up] when gated) and down projections are packed as the linear layers are — float32
panels, int8 panels with per-channel scales, or bfloat16 panels — and stacked, so one call runs every chosen expert
over its tokens with the same panel kernels as the dense linears. The PyTorch MoE (`layers/moe.py`) is the
reference; tests compare the two, and the decode plans record these same calls.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from workers.model.kernels import native, native_bf16

if TYPE_CHECKING:  # the kernels sit below the model's config: only its type is named here
    from workers.model.checkpoint.config import FeedForwardConfig

ROUTERS = {"softmax": 0, "sigmoid": 1}  # csrc/moe.c's router kinds
FORMATS = {None: 0, "int8_weight_only": 1, "bfloat16": 2}  # and its expert weight formats


@dataclasses.dataclass
class PackedExperts:
    """A MoE block's experts as stacked panels: `up` [E, …] and `down` [E, …] in `weight_format` (None: float32),
    with per-expert scales [E, out] for int8. `bf16_path` is the process's bfloat16 kernel path."""

    weight_format: str | None
    up: torch.Tensor
    down: torch.Tensor
    up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None
    width: int  # the experts' input and output width (the hidden size, or a latent size)
    intermediate_size: int
    gated: bool
    bf16_path: str | None = None

    @property
    def num_experts(self) -> int:
        """How many experts are stacked."""
        return self.up.shape[0]

    def nbytes(self) -> int:
        """Bytes the packed experts hold."""
        parts = (self.up, self.down, self.up_scale, self.down_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _pack_one(weight: torch.Tensor, weight_format: str | None, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if weight_format == "int8_weight_only":
        return native.pack_panels_int8(weight, width)
    if weight_format == "bfloat16":
        return native_bf16.pack_panels_bf16(weight, width), None
    return native.pack_panels(weight.float(), width), None


def _pack_stack(
    weights: torch.Tensor, weight_format: str | None, width: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[E, N, K] → stacked panels [E, …] (and scales [E, N]), one expert at a time (no second copy of them all)."""
    first, first_scale = _pack_one(weights[0], weight_format, width)
    panels = first.new_empty(weights.shape[0], *first.shape)
    scales = None if first_scale is None else first_scale.new_empty(weights.shape[0], *first_scale.shape)
    for e in range(weights.shape[0]):
        one, scale = (first, first_scale) if e == 0 else _pack_one(weights[e], weight_format, width)
        panels[e] = one
        if scales is not None:
            scales[e] = scale
    return panels, scales


def pack_experts(up: torch.Tensor, down: torch.Tensor, gated: bool, weight_format: str | None) -> PackedExperts:
    """Pack `up` [E, (2)I, w] and `down` [E, w, I] in `weight_format` (None, "int8_weight_only" or "bfloat16")."""
    if weight_format not in FORMATS:
        raise ValueError(f"expert weight format {weight_format!r} is invalid: must be one of {list(FORMATS)}")
    panel = int(native.load().linear_panel_width())
    up_panels, up_scale = _pack_stack(up, weight_format, panel)
    down_panels, down_scale = _pack_stack(down, weight_format, panel)
    path = native_bf16.bf16_path() if weight_format == "bfloat16" else None
    width, inter = down.shape[1], down.shape[2]
    return PackedExperts(weight_format, up_panels, down_panels, up_scale, down_scale, width, inter, gated, path)


def route(logits: torch.Tensor, ff: FeedForwardConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [t, E] float32 → (weights [t, k] float32, expert ids [t, k] int64), as `moe.route` chooses."""
    t, k = logits.shape[0], ff.experts_per_token
    weights, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int64)
    failed = native.load().moe_route(
        native.pointer(logits.contiguous()),
        weights.data_ptr(),
        ids.data_ptr(),
        t,
        ff.num_experts,
        k,
        ROUTERS[ff.router],
        int(ff.norm_topk_prob),
        ff.num_expert_groups,
        ff.topk_groups,
        native.pointer(bias),
        ff.routed_scaling_factor,
        ff.topk_norm_eps,
    )
    if failed:
        raise MemoryError(f"moe_route could not allocate its scratch for {ff.num_experts} experts")
    return weights, ids


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, packed: PackedExperts) -> torch.Tensor:
    """x [t, w] → [t, w]: each row's weighted sum over its chosen experts, in slot order. An id of -1 (expert
    parallel: an expert another rank holds) is skipped; a row whose ids are all -1 gets zeros."""
    out = torch.empty(x.shape[0], packed.width)
    failed = native.load().moe_experts(*experts_arguments(x, weights, ids, out, packed), torch.get_num_threads())
    if failed == 2:
        raise MemoryError(f"moe_experts could not allocate its scratch for {x.shape[0]} rows")
    if failed:
        raise ValueError(f"expert ids must lie in [0, {packed.num_experts}) or be -1 (another rank's expert)")
    return out


def experts_arguments(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, packed: PackedExperts
) -> list:
    """`moe_experts`' arguments but the thread count (the decode plans record the same list)."""
    if ids.dtype != torch.int64 or not ids.is_contiguous() or x.shape[1] != packed.width:
        raise ValueError(f"x {tuple(x.shape)} and ids {ids.dtype} do not fit experts of width {packed.width}")
    scales = [None if s is None else native.pointer(s) for s in (packed.up_scale, packed.down_scale)]
    path = native_bf16.BF16_PATHS[packed.bf16_path] if packed.bf16_path is not None else 0
    return [
        native.pointer(x),
        native.pointer(weights),
        ids.data_ptr(),
        native.pointer(out),
        x.shape[0],
        ids.shape[1],
        packed.num_experts,
        packed.width,
        packed.intermediate_size,
        0 if packed.gated else 1,
        FORMATS[packed.weight_format],
        path,
        packed.up.data_ptr(),
        scales[0],
        packed.up[0].numel(),
        packed.down.data_ptr(),
        scales[1],
        packed.down[0].numel(),
    ]


def combine(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """routed + shared · sigmoid(gate) (gate [t, 1] or None: + shared) over [t, d] rows."""
    out = torch.empty_like(routed)
    gate = None if gate is None else gate.reshape(-1).contiguous()
    native.load().moe_combine(
        native.pointer(routed),
        native.pointer(shared),
        native.pointer(gate),
        native.pointer(out),
        routed.shape[0],
        routed.shape[1],
    )
    return out
