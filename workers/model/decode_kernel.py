"""How a loaded model runs its decode steps: which kernels each mixer, norm and MLP uses (`prepare_decode_kernel`)."""

from __future__ import annotations

import torch

from workers.model.kernels import native, triton_kernels
from workers.model.layers.attention import Attention
from workers.model.layers.feed_forward import MLP
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.norm import RMSNorm
from workers.model.layers.shared_block import SharedBlockUse
from workers.model.layers.short_conv import ShortConvMixer

# Mixers with Triton decode steps besides Mamba2 and Gated DeltaNet (`decode_kernel` "triton" selects them).
TRITON_STEP_MIXERS = (Mamba1Mixer, KimiDeltaAttentionMixer, ShortConvMixer)
DECODE_KERNELS = ("auto", "torch", "compile", "native", "triton")


def prepare_decode_kernel(model: torch.nn.Module, kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """Choose how `model` runs its decode steps (Mamba2, Mamba1 and Gated DeltaNet mixers, attention, norms, MLPs); returns
    the choice made.

    "torch": the reference PyTorch path. "compile": the SSM update fused by `torch.compile` (any device; compiles
    at first use). "native": the C kernels of `workers/model/kernels/csrc` (CPU, float32; built at first use) for the
    Mamba2, Gated DeltaNet and Kimi Delta Attention steps (KDA prompts too), the attention and latent attention
    decode steps and the per-token elementwise work around them (RMSNorm fused with the residual add, the MLP's
    silu(gate) · up, Zamba2's gelu(gate) · up). "triton": the fused Triton kernels of
    `workers/model/kernels/triton_kernels` for the Mamba2, Gated DeltaNet, Mamba1, Kimi Delta Attention and short conv
    decode steps and their state shifts after verification (CUDA; CPU only under TRITON_INTERPRET=1). "auto": native
    where it applies and builds, triton on CUDA where triton imports, else torch.
    """
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={kernel!r} is invalid: must be one of {', '.join(DECODE_KERNELS)}")
    device = torch.device(device)
    native_fits = device.type == "cpu" and dtype == torch.float32
    if kernel == "native":
        if not native_fits:
            raise ValueError(f"decode_kernel='native' needs a CPU and float32 weights, not {device} / {dtype}")
        native.load()  # raises NativeKernelError with the compiler's message
    if kernel == "triton" and not triton_kernels.available(device):
        raise ValueError(f"decode_kernel='triton' cannot run here: {triton_kernels.unavailable_reason(device)}")
    if kernel == "auto":
        if native_fits and native.available():
            kernel = "native"
        elif device.type == "cuda" and triton_kernels.available(device):
            kernel = "triton"
        else:
            kernel = "torch"
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            fused = kernel in ("native", "triton")  # their fused gated norm is rmsnorm(y · silu(z)) only
            module.decode_kernel = "torch" if fused and not module.config.fused_kernels_fit else kernel
        elif isinstance(module, GatedDeltaNetMixer):
            module.decode_kernel = kernel if kernel in ("native", "triton") else "torch"  # no compiled GDN step
        elif isinstance(module, KimiDeltaAttentionMixer):  # native (C, CPU float32), triton (below) or torch
            module.decode_kernel = "native" if kernel == "native" else "torch"
        elif isinstance(module, Mamba1Mixer):  # native (C, CPU float32), triton (below) or the torch reference
            module.decode_kernel = "native" if kernel == "native" else "torch"
        elif isinstance(module, ShortConvMixer):
            module.decode_kernel = "native" if kernel == "native" else "torch"  # "triton": set below
        elif isinstance(module, (RMSNorm, MLP, Attention, SharedBlockUse, MultiHeadLatentAttention)):
            module.native = kernel == "native"  # the per-token elementwise work goes native along with it
        if kernel == "triton" and isinstance(module, TRITON_STEP_MIXERS):
            module.decode_kernel = "triton"  # their one-token steps and state shifts (kernels/triton_kernels)
    return kernel
