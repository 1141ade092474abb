"""int8 × int8 linears (quantization="int8"): int8 weights per output channel and group of inputs, activations
quantized to int8 per row and group at each call, integer sums exact within a group (csrc/linear_w8a8.c).

Glossary as in `workers/model/kernels/w8a8.py`: M rows, N outputs, K inputs, G inputs per group.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.kernels import w8a8
from workers.model.layers.linear import NativeLinear

# Inputs per quantization group, weights and activations alike (None: one group per row / output channel). Chosen
# by measurement on the demo prompts (benchmarks/quantization_quality.py; docs/benchmarks.md, int8 section).
BLOCK_GROUP_SIZE: int | None = None
HEAD_GROUP_SIZE: int | None = 32


class W8A8Linear(NativeLinear):
    """A Linear whose weight lives only as int8 panels for the int8 × int8 kernel (CPU; inference only). It is a
    NativeLinear for the decode plans (`panels`, `scale` and `bias` are the packed weight's; `packed` has it all)."""

    def __init__(self, linear: nn.Linear, group_size: int | None):  # not super().__init__: it packs float panels
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = w8a8.pack(linear.weight.detach(), group_size)
        self.panels, self.scale = self.packed.panels, self.packed.scale
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        rows = x.reshape(-1, self.in_features).contiguous()
        return w8a8.linear(rows, self.packed, self.bias).reshape(*x.shape[:-1], self.out_features)


class W8A8Reference(nn.Module):
    """The same int8 × int8 linear in PyTorch (the reference for W8A8Linear, and the path where it cannot run):
    the kernel's quantization rules, exact integer sums per group, groups folded in order."""

    def __init__(self, linear: nn.Linear, group_size: int | None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = w8a8.group_size_for(self.in_features, group_size)
        self.weight_int8, self.scale = w8a8.quantize_weight(linear.weight.detach(), self.group_size)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out] in float32."""
        rows = x.reshape(-1, self.in_features).float()
        q, row_scale = w8a8.quantize_activations(rows, self.group_size)  # [M, groups, G], [M, groups]
        out = rows.new_zeros(rows.shape[0], self.out_features)
        for g in range(q.shape[1]):  # float64 holds these integer sums exactly
            sums = (q[:, g].double() @ self.weight_int8[:, g].double().t()).float()  # [M, N]
            out = out + sums * (self.scale[None, :, g] * row_scale[:, g, None])
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def replacement(linear: nn.Linear, backend: str, head: bool) -> nn.Module:
    """The int8 × int8 module `linear` becomes: the native kernel ("native") or the PyTorch reference; the LM head
    with `HEAD_GROUP_SIZE`, block linears with `BLOCK_GROUP_SIZE`."""
    group_size = HEAD_GROUP_SIZE if head else BLOCK_GROUP_SIZE
    if backend == "native":
        return W8A8Linear(linear, group_size)
    return W8A8Reference(linear, group_size)
