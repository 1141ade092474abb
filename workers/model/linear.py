"""How Linear layers multiply on this device: oneDNN-packed weights on CPU float32, else torch's own.

CPU BLAS handles decode-sized batches (a few rows) poorly; oneDNN with a weight reordered once at load runs the
bench model's linears ~3× faster at 8 rows and ~2× at 32 (measured on 2 cores). The pure-torch `F.linear` path stays
the reference (`linear_backend="torch"`), and tests compare the two.
"""

from __future__ import annotations

import torch
from torch import nn

LINEAR_BACKENDS = ("auto", "torch", "onednn")
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


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears can run here."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepare_linears(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Switch every nn.Linear of `model` to the chosen backend after its weights are loaded; returns the one used."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r} is invalid: must be one of {', '.join(LINEAR_BACKENDS)}")
    if backend == "onednn" and not onednn_available(device, dtype):
        raise ValueError("linear_backend='onednn' needs a CPU, float32 weights and a torch built with oneDNN")
    use_onednn = backend == "onednn" or (backend == "auto" and onednn_available(device, dtype))
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                if use_onednn:
                    setattr(parent, name, PackedLinear(child))
                elif child.weight.is_contiguous():
                    # Same shape, transposed strides: F.linear then multiplies by a contiguous [in, out] matrix,
                    # which BLAS runs as a faster matrix-vector product for decode-sized batches.
                    child.weight.data = child.weight.data.t().contiguous().t()
    return "onednn" if use_onednn else "torch"
