"""Torch kernels of LFM2's short convolution: a depthwise causal conv without activation over `B · x`.

Shapes: b batch, l new tokens, d channels (the model width), W taps (`conv_L_cache`). The state is the window of
the last W-1 conv inputs, [b, d, W-1]; a row's new window is the last W-1 entries of `[old window, u_0 …
u_{num_tokens-1}]` (`conv_window_after`), so padding never enters it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
