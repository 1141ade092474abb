"""int8 × int8 linears (quantization="int8"): int8 weights per output channel and group of inputs, activations
quantized to int8 per row and group at each call, integer sums exact within a group (csrc/linear_w8a8.c).

Glossary as in `workers/model/kernels/w8a8.py`: M rows, N outputs, K inputs, G inputs per group.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.kernels import w8a8
from workers.model.layers.native_linear import NativeLinear

# Inputs per quantization group, weights and activations alike (None: one group per row / output channel). Chosen
# by measurement on the demo prompts (benchmarks/quantization_quality.py; docs/benchmarks.md, int8 section).
BLOCK_GROUP_SIZE: int | None = None
HEAD_GROUP_SIZE: int | None = 32
# The LM head's top logits per row recomputed in float32 from the float weight (the tied embeddings: no copy), so
# greedy tokens stay float32's unless its best token falls outside the int8 head's top HEAD_TOP_K (0: none).
HEAD_TOP_K = 8


class W8A8Linear(NativeLinear):
    """A Linear whose weight lives only as int8 panels for the int8 × int8 kernel (CPU; inference only). It is a
    NativeLinear for the decode plans (`panels`, `scale` and `bias` are the packed weight's; `packed` has it all).
    `top_k` > 0 (an LM head): each row's top_k outputs recomputed in float32 from `float_weight` (kept, not copied)."""

    def __init__(self, linear: nn.Linear, group_size: int | None, top_k: int = 0):  # not super().__init__: float
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = w8a8.pack(linear.weight.detach(), group_size)
        self.panels, self.scale = self.packed.panels, self.packed.scale
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.top_k, self.bf16_path = top_k, None
        self.float_weight = linear.weight.detach().float().contiguous() if top_k else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        rows = x.reshape(-1, self.in_features).contiguous()
        out = w8a8.linear(rows, self.packed, self.bias)
        if self.float_weight is not None:
            w8a8.rescore_top(rows, self.float_weight, self.bias, out, self.top_k)
        return out.reshape(*x.shape[:-1], self.out_features)


class W8A8Reference(nn.Module):
    """The same int8 × int8 linear in PyTorch (the reference for W8A8Linear, and the path where it cannot run):
    the kernel's quantization rules, exact integer sums per group, groups folded in order, the top_k re-ranked."""

    def __init__(self, linear: nn.Linear, group_size: int | None, top_k: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = w8a8.group_size_for(self.in_features, group_size)
        self.weight_int8, self.scale = w8a8.quantize_weight(linear.weight.detach(), self.group_size)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.top_k = top_k
        self.float_weight = linear.weight.detach().float() if top_k else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out] in float32."""
        rows = x.reshape(-1, self.in_features).float()
        q, row_scale = w8a8.quantize_activations(rows, self.group_size)  # [M, groups, G], [M, groups]
        out = rows.new_zeros(rows.shape[0], self.out_features)
        for g in range(q.shape[1]):  # float64 holds these integer sums exactly
            sums = (q[:, g].double() @ self.weight_int8[:, g].double().t()).float()  # [M, N]
            out = out + sums * (self.scale[None, :, g] * row_scale[:, g, None])
        out = out if self.bias is None else out + self.bias
        if self.float_weight is not None:  # a stable sort: ties keep the lower index first, as the kernel
            top = torch.sort(out, dim=1, descending=True, stable=True)[1][:, : self.top_k]  # [M, top_k]
            exact = torch.einsum("mk,mtk->mt", rows, self.float_weight[top])
            out.scatter_(1, top, exact if self.bias is None else exact + self.bias[top])
        return out.reshape(*x.shape[:-1], self.out_features)


def replacement(linear: nn.Linear, backend: str, head: bool) -> nn.Module:
    """The int8 × int8 module `linear` becomes: the native kernel ("native") or the PyTorch reference; the LM head
    with `HEAD_GROUP_SIZE` and `HEAD_TOP_K`, block linears with `BLOCK_GROUP_SIZE`."""
    group_size, top_k = (HEAD_GROUP_SIZE, HEAD_TOP_K) if head else (BLOCK_GROUP_SIZE, 0)
    if backend == "native":
        return W8A8Linear(linear, group_size, top_k)
    return W8A8Reference(linear, group_size, top_k)
