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
from workers.model.layers import linear_w8a8
from workers.model.layers.moe import MoE
from workers.model.layers.native_linear import NativeLinear

LINEAR_BACKENDS = ("auto", "torch", "onednn", "native")
# None: the checkpoint's weights in dtype. Block linears: int8 weights per output channel × float32 activations
# ("int8", vLLM's name; "int8_weight_only", torchao's) or × int8 activations ("w8a8": faster from batch 8, below the
# quality gate on the demo prompts). The LM head: int8 × int8 per group with its top logits recomputed in float32
# ("int8", "w8a8"; linear_w8a8.py) or float32 ("int8_weight_only"). Chosen by measurement: docs/benchmarks.md.
QUANTIZATIONS = ("int8", "int8_weight_only", "w8a8")
W8A8_LINEARS = {"int8": "head", "w8a8": "all"}  # the linears each quantization multiplies int8 × int8
# How a linear stores its weight besides float32: a quantization, or "bfloat16" (dtype="bfloat16" on CPU: bf16
# weights, float32 activations; see loader.resolve_weight_format).
WEIGHT_FORMATS = (*QUANTIZATIONS, "bfloat16")
# The experts' panels per weight format: int8 weights × float32 activations for every int8 quantization.
EXPERT_FORMATS = {"int8": "int8_weight_only", "w8a8": "int8_weight_only"}
SAME_FORMAT = "same"  # prepare_linears' expert_format default: the experts take the linears' format
FLOAT_LINEARS = ("shared_gate",)  # a one-output gate per token: no bytes to save, a sigmoid to keep exact
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


class Int8Linear(nn.Module):
    """A Linear with int8 weights quantized per output channel, multiplied by PyTorch (weights widened to float at
    each call: the reference for the native int8 kernel, and the path where it cannot run)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8, self.scale = quantize_int8(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]: (x · qᵀ) · scale (+ bias), in x's dtype."""
        out = nn.functional.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scale [N] float32) with weight ≈ q · scale[:, None] (the
    rule `native.pack_panels_int8` packs)."""
    weight = weight.float()
    scale = torch.maximum(weight.amax(dim=1), -weight.amin(dim=1)) / 127  # max |w| without a copy of |w|
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears can run here."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepare_linears(
    model: nn.Module,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    replaced: dict[int, nn.Module] | None = None,
    expert_format: str | None = SAME_FORMAT,
) -> str:
    """Switch every nn.Linear of `model` to the chosen backend after its weights are loaded; returns the one used.

    "auto": the native panel kernel on CPU float32 (oneDNN when no C compiler is found), torch elsewhere.
    `quantization` (CPU; see QUANTIZATIONS): the weights quantized per output channel, multiplied by the native int8
    kernels ("auto", "native") or by PyTorch ("torch"); gates named in `FLOAT_LINEARS` stay float.
    On the native backend each MoE block's experts are packed too (`MoE.pack`; int8 panels for every int8
    quantization), in `expert_format` where it is given (the blocks' format, for an MTP head whose linears take the
    LM head's). `quantization="bfloat16"` (a weight format of `WEIGHT_FORMATS`, set by the loader for dtype="bfloat16" on CPU):
    bf16 panels for the native kernel ("auto", "native" only).
    `replaced` (id of a Linear → its replacement), kept across calls that prepare a model part by part: a Linear
    shared by several parents (Zamba2's shared blocks) is replaced once, in every parent. The Linears themselves are
    not kept (their weights are freed as they are replaced); every id looked up is of a Linear built with the model,
    all alive together then, so no two share an id.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r} is invalid: must be one of {', '.join(LINEAR_BACKENDS)}")
    check_weight_format(quantization, device, dtype)
    cpu_float32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if backend == "onednn" and not onednn_available(device, dtype):
        raise ValueError("linear_backend='onednn' needs a CPU, float32 weights and a torch built with oneDNN")
    if backend == "onednn" and quantization is not None:
        raise ValueError(f"linear_backend='onednn' has no {quantization} weights: use 'auto', 'native' or 'torch'")
    if quantization == "bfloat16" and backend not in ("auto", "native"):
        raise ValueError(f"bfloat16 weight panels need linear_backend 'auto' or 'native', not {backend!r}")
    if backend == "native":
        if not cpu_float32:
            raise ValueError(f"linear_backend='native' needs a CPU and float32 weights, not {device} / {dtype}")
        native.load()  # raises NativeKernelError with the compiler's message
    if backend == "auto":
        backend = "torch"
        if cpu_float32 and native.available():
            backend = "native"
        elif onednn_available(device, dtype) and quantization is None:
            backend = "onednn"
    if backend != "native" and quantization == "bfloat16":
        native.load()  # bfloat16 panels exist only natively: raises NativeKernelError with the compiler's message
    replaced = {} if replaced is None else replaced
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    if id(child) not in replaced:
                        kind = None if name in FLOAT_LINEARS else quantization
                        replaced[id(child)] = _replacement(child, backend, kind, name == "lm_head")
                    setattr(parent, name, replaced[id(child)])
        if backend == "native":  # experts packed like the linears
            expert_format = quantization if expert_format == SAME_FORMAT else expert_format
            for moe in [m for m in model.modules() if isinstance(m, MoE) and m.packed is None]:
                moe.pack(EXPERT_FORMATS.get(expert_format, expert_format))
    return backend


def _replacement(linear: nn.Linear, backend: str, quantization: str | None, head: bool = False) -> nn.Module:
    """The module `linear` becomes on `backend` (itself, re-strided, on the float torch path); `head`: the LM head."""
    if W8A8_LINEARS.get(quantization) == "all" or (quantization in W8A8_LINEARS and head):
        return linear_w8a8.replacement(linear, backend, head)
    if quantization in QUANTIZATIONS:
        quantization = "int8_weight_only"  # the int8 panels of the blocks' linears
    if backend == "native":
        return NativeLinear(linear, quantization)
    if quantization == "int8_weight_only":
        return Int8Linear(linear)
    if backend == "onednn":
        return PackedLinear(linear)
    if linear.weight.is_contiguous():
        # Same shape, transposed strides: F.linear then multiplies by a contiguous [in, out] matrix, which BLAS
        # runs as a faster matrix-vector product for decode-sized batches.
        linear.weight.data = linear.weight.data.t().contiguous().t()
    return linear


def check_weight_format(weight_format: str | None, device: torch.device | str, dtype: torch.dtype) -> None:
    """`ValueError` unless the weight format (`WEIGHT_FORMATS`, or None) can run on `device` with `dtype` activations."""
    if weight_format != "bfloat16":
        return check_quantization(weight_format, device, dtype)
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(f"{weight_format} weight panels run on CPU with float32 activations, not {device} / {dtype}")


def check_quantization(quantization: str | None, device: torch.device | str, dtype: torch.dtype) -> None:
    """`ValueError` naming the allowed values unless `quantization` can run on `device` with `dtype` weights."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization={quantization!r} is invalid: must be one of {', '.join(QUANTIZATIONS)} "
            "(or None for the checkpoint's weights in dtype)"
        )
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} runs on CPU with float32 activations (dtype 'auto' or "
            f"'float32'), not {device} / {dtype}"
        )
