"""RMS norms, computed in float32 and cast back to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.distributed.layout import TensorParallel
from workers.model.kernels import native


class RMSNorm(nn.Module):
    """y = weight · x / rms(x) over the last dimension."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = False  # run through the native kernel (set at load for CPU float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] → [..., d]."""
        if self.native and native.fits(x, self.weight):
            return native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same arithmetic
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)

    def add_and_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, alpha: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + alpha · delta, its norm): a residual connection and the next pre-norm, fused when native.

        `hidden` may be updated in place: callers pass a tensor nothing else holds.
        """
        if self.native and native.fits(hidden, delta, self.weight):
            return hidden, native.add_rms_norm(hidden, delta, alpha, self.weight, self.eps)
        hidden = hidden + delta if alpha == 1.0 else torch.add(hidden, delta, alpha=alpha)
        return hidden, self(hidden)


class GatedRMSNorm(nn.Module):
    """Mamba2's grouped gated norm (norm_before_gate=False): rmsnorm(y · silu(z)) per group of channels.

    `norm_before_gate` (a Falcon-H1 variant): rmsnorm(y) · silu(z) instead."""

    def __init__(self, size: int, num_groups: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.num_groups = num_groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, z [..., d] → [..., d] in `out_dtype`."""
        gated = y.float() if self.norm_before_gate else y.float() * F.silu(z.float())
        grouped = gated.view(*gated.shape[:-1], self.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight.float() * grouped.view_as(gated)
        if self.norm_before_gate:
            normed = normed * F.silu(z.float())
        return normed.to(out_dtype)


class SpanningGatedRMSNorm(nn.Module):
    """`GatedRMSNorm` for a rank whose channels are a slice of one norm group that spans `span` tensor-parallel
    ranks (Mamba2 with fewer B/C groups than ranks: Granite, Bamba with g = 1).

    The rank holds channels `[rank·size, +size)` of the full width, all inside global group `rank // span` (of
    `tp.size // span` groups, each `span · size` wide). Its sum of squares per global group `[..., g]` (zero in the
    groups it does not touch) is all-reduced, so each rank scales its slice by the whole group's mean square: one
    all-reduce of g floats per token. The result is the unsplit norm's slice (up to float32 summation order)."""

    def __init__(self, size: int, eps: float, norm_before_gate: bool, tp: TensorParallel, span: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.num_groups = 1  # local groups: the slice of one group
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.tp = tp
        self.group_index, self.global_groups = tp.rank // span, tp.size // span
        self.group_width = size * span

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, z [..., size] (this rank's channels) → [..., size] in `out_dtype`."""
        gated = y.float() if self.norm_before_gate else y.float() * F.silu(z.float())
        sums = gated.new_zeros(*gated.shape[:-1], self.global_groups)  # [..., g] Σ x² per global group
        sums[..., self.group_index] = gated.pow(2).sum(-1)
        sums = self.tp.group.all_reduce_(sums)[..., self.group_index, None]
        normed = self.weight.float() * (gated * torch.rsqrt(sums / self.group_width + self.eps))
        if self.norm_before_gate:
            normed = normed * F.silu(z.float())
        return normed.to(out_dtype)


class SiluGate(nn.Module):
    """The gate without a norm (Falcon-H1 with mamba_rms_norm false): y · silu(z); no weights."""

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, z [..., d] → [..., d] in `out_dtype`."""
        return (y.float() * F.silu(z.float())).to(out_dtype)


class HeadGatedRMSNorm(nn.Module):
    """The Gated DeltaNet's output norm (norm before gate): weight · rmsnorm(y) · silu(z) over each head's channels."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, z [..., heads, head_dim] → [..., heads, head_dim] in `out_dtype`."""
        y = y.float()
        normed = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(out_dtype)
        return (self.weight * normed * F.silu(z.float())).to(out_dtype)


class PassThroughNorm(nn.Module):
    """The pre-norm slot of a post-norm block (OLMo 2/3): its mixer reads the residual stream as it is."""

    native = False  # nothing to run: a decode plan copies the residual stream for it (`lfm_olmo_records.py`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] → x."""
        return x

    def add_and_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, alpha: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + alpha · delta, the same tensor): the residual connection, no norm after it."""
        hidden = hidden + delta if alpha == 1.0 else torch.add(hidden, delta, alpha=alpha)
        return hidden, hidden
