"""Kernels of LFM2's short convolution: a depthwise causal conv without activation over `B · x` — the torch
reference, and the native decode step (`csrc/short_conv.c`, which a decode plan's records call too).

Shapes: b batch, l new tokens, d channels (the model width), W taps (`conv_L_cache`). The state is the window of
the last W-1 conv inputs, [b, d, W-1]; a row's new window is the last W-1 entries of `[old window, u_0 …
u_{num_tokens-1}]` (`conv_window_after`), so padding never enters it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.kernels import native
from workers.model.kernels.ssd import conv_window_after


def short_conv(
    u: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """u [b, l, d] conv inputs continuing `window` [b, d, W-1]; weight [d, W] → (out [b, l, d], new window)."""
    extended = torch.cat([window.to(u.dtype), u.transpose(1, 2)], dim=-1)  # [b, d, W-1+l]
    out = F.conv1d(extended.to(weight.dtype), weight.unsqueeze(1), bias, groups=u.shape[2]).to(u.dtype)
    return out.transpose(1, 2), conv_window_after(window, u, num_tokens)


def short_conv_step_(
    u: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One token per row: u [b, 1, d] → out [b, 1, d], shifting `window` [b, d, W-1] in place."""
    extended = torch.cat([window.to(u.dtype), u.transpose(1, 2)], dim=-1)  # [b, d, W]
    out = (extended.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    window.copy_(extended[..., 1:])
    return out.to(u.dtype)[:, None, :]


def native_short_conv_step_(
    proj: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One token per row through `csrc/short_conv.c`: proj [b, 3d] (in_proj output B | C | x) → the out_proj input
    C · conv(B · x) [b, d], shifting `window` [b, d, W-1] in place. float32, contiguous, on CPU."""
    b, width = proj.shape
    d, taps = weight.shape
    if width != 3 * d or tuple(window.shape) != (b, d, taps - 1) or (bias is not None and bias.shape != (d,)):
        raise ValueError(
            f"shape mismatch: proj {tuple(proj.shape)}, window {tuple(window.shape)}, weight {tuple(weight.shape)}"
        )
    u, out = torch.empty(b, d), torch.empty(b, d)
    native.load().short_conv_step(
        native.pointer(proj),
        native.pointer(window),
        native.pointer(weight),
        native.pointer(bias),
        native.pointer(u),
        native.pointer(out),
        b,
        d,
        taps,
        torch.get_num_threads(),
    )
    return out
