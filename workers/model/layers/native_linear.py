"""A Linear whose weight lives only as column panels for the native CPU kernels (float32, int8 or bfloat16 panels).

Its own module so that `linear.py` (which chooses each Linear's replacement) and `linear_w8a8.py` (whose int8 × int8
Linear is a NativeLinear for the decode plans) both build on it without importing each other.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.kernels import native, native_bf16


class NativeLinear(nn.Module):
    """A Linear whose weight lives only as column panels for the native kernel (CPU float32; inference only).

    `weight_format="int8_weight_only"`: the panels hold the weight quantized per output channel (int8, `scale`
    [out]) and the int8 kernel multiplies them (csrc/linear_int8.c); `scale` is None otherwise. "bfloat16": bf16
    panels of k pairs for csrc/linear_bf16.c, run by `bf16_path` (the process's kernel path, fixed at construction)."""

    def __init__(self, linear: nn.Linear, weight_format: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.scale: torch.Tensor | None = None
        self.bf16_path: str | None = None
        if weight_format == "int8_weight_only":
            self.panels, self.scale = native.pack_panels_int8(linear.weight.detach())
        elif weight_format == "bfloat16":
            self.bf16_path = native_bf16.bf16_path()
            self.panels = native_bf16.pack_panels_bf16(linear.weight.detach(), int(native.load().linear_panel_width()))
        else:
            self.panels = native.pack_panels(linear.weight.detach().float())
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.scale is not None:
            out = native.linear_int8(rows, self.panels, self.scale, self.bias, self.out_features)
        elif self.bf16_path is not None:
            out = native_bf16.linear_bf16(rows, self.panels, self.bias, self.out_features, self.bf16_path)
        else:
            out = native.linear(rows, self.panels, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)
