"""How Linear layers multiply on this device: the native panel kernel or oneDNN on CPU float32, else torch's own.

CPU BLAS handles decode-sized batches (a few rows) poorly; oneDNN with a weight reordered once at load runs the
bench model's linears ~3× faster at 8 rows and ~2× at 32 (measured on 2 cores), and the native kernel
(`csrc/linear.c`, weight packed into column panels) streams the weight faster still at 1–8 rows, with a few µs
per call instead of ~25. The pure-torch `F.linear` path stays the reference (`linear_backend="torch"`), and tests
compare the others with it.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.kernels import native

LINEAR_BACKENDS = ("auto", "torch", "onednn", "native")
PACKING_BATCH_HINT = 32  # oneDNN picks its weight layout for this many rows; measured fine from 1 to 256 rows


class PackedLinear(nn.Module):
    """A Linear whose weight lives only in oneDNN's packed layout (read-only; inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACKING_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


class NativeLinear(nn.Module):
    """A Linear whose weight lives only as column panels for the native kernel (CPU float32; inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.panels = native.pack_panels(linear.weight.detach().float())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        rows = x.reshape(-1, self.in_features).contiguous()
        return native.linear(rows, self.panels, self.bias, self.out_features).reshape(*x.shape[:-1], self.out_features)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears can run here."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepare_linears(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Switch every nn.Linear of `model` to the chosen backend after its weights are loaded; returns the one used.

    "auto": the native panel kernel on CPU float32 (oneDNN when no C compiler is found), torch elsewhere.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r} is invalid: must be one of {', '.join(LINEAR_BACKENDS)}")
    cpu_float32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if backend == "onednn" and not onednn_available(device, dtype):
        raise ValueError("linear_backend='onednn' needs a CPU, float32 weights and a torch built with oneDNN")
    if backend == "native":
        if not cpu_float32:
            raise ValueError(f"linear_backend='native' needs a CPU and float32 weights, not {device} / {dtype}")
        native.load()  # raises NativeKernelError with the compiler's message
    if backend == "auto":
        backend = "torch"
        if cpu_float32 and native.available():
            backend = "native"
        elif onednn_available(device, dtype):
            backend = "onednn"
    replacement = {"native": NativeLinear, "onednn": PackedLinear}.get(backend)
    replaced: dict[int, nn.Module] = {}  # a Linear shared by several parents (Zamba2's shared blocks) is replaced once
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                if replacement is not None:
                    if id(child) not in replaced:
                        replaced[id(child)] = replacement(child)
                    setattr(parent, name, replaced[id(child)])
                elif child.weight.is_contiguous():
                    # Same shape, transposed strides: F.linear then multiplies by a contiguous [in, out] matrix,
                    # which BLAS runs as a faster matrix-vector product for decode-sized batches.
                    child.weight.data = child.weight.data.t().contiguous().t()
    return backend
