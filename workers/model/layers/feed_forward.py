"""Dense feed-forward mixers: gated (SwiGLU) and relu² MLPs (the mixture-of-experts block is in `moe.py`).

Tensor parallel: the rank holds intermediate channels `[r·I_l, +I_l)` (`intermediate_size` is the local I_l): those
rows of the gate and of the up projection, and those input columns of down_proj, which is row-parallel: the output
is a partial sum the model all-reduces (down_proj's bias on rank 0 only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule, columns, rows
from workers.model.kernels import native


def activate(h: torch.Tensor, gated: bool, use_native: bool = False) -> torch.Tensor:
    """silu(gate) · up for fused [gate, up] inputs, else relu(h)²."""
    if gated and use_native and native.fits(h):
        return native.silu_mul(h)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.relu(h).square()


class MLP(nn.Module):
    """Dense MLP; `up_proj` holds [gate; up] fused when the MLP is gated."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, gated: bool, bias: bool, tp: TensorParallel = SINGLE_TP
    ):
        """`intermediate_size`: this rank's share (the local config's); `tp`: its place in the tensor-parallel group."""
        super().__init__()
        self.gated = gated
        self.tp = tp
        self.up_proj = nn.Linear(hidden_size, intermediate_size * (2 if gated else 1), bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.native = False  # activation through the native kernel (set at load for CPU float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., d]."""
        return self.down_proj(activate(self.up_proj(hidden), self.gated, self.native))

    def shard_rules(self) -> dict[str, ShardRule]:
        """How each parameter of this rank is cut from the unsplit MLP's (the layout in the module docstring)."""
        width = self.down_proj.weight.shape[1]  # I_l
        mine = (self.tp.rank * width, width)
        up = rows(mine, (self.tp.size * width + mine[0], width)) if self.gated else rows(mine)  # [gate | up]
        rules = {"up_proj.weight": up, "down_proj.weight": columns(mine)}
        if self.up_proj.bias is not None:
            rules.update({"up_proj.bias": up, "down_proj.bias": ShardRule(rank0_only=True)})
        return rules
