"""Dense feed-forward mixers: gated (SwiGLU) and relu² MLPs (the mixture-of-experts block is in `moe.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool, bias: bool):
        super().__init__()
        self.gated = gated
        self.up_proj = nn.Linear(hidden_size, intermediate_size * (2 if gated else 1), bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.native = False  # activation through the native kernel (set at load for CPU float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., d]."""
        return self.down_proj(activate(self.up_proj(hidden), self.gated, self.native))
