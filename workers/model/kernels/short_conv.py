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


def native_short_conv_prefill(
    proj: torch.Tensor,
    num_tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (or the next chunk of them) through `csrc/short_conv.c`: proj [b, l, 3d] (in_proj output B | C | x,
    right-padded; num_tokens [b] int64 valid tokens per row) continuing `window` [b, d, W-1] (None: zeros) →
    (out [b, l, d] the out_proj input, the window after each row's last valid token, u [b, l, d] the conv inputs).
    float32, on CPU; `window` is left as it was."""
    b, length, width = proj.shape
    d, taps = weight.shape
    if width != 3 * d or (window is not None and tuple(window.shape) != (b, d, taps - 1)):
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, weight {tuple(weight.shape)}")
    if not (num_tokens.dtype == torch.int64 and num_tokens.is_contiguous() and num_tokens.shape == (b,)):
        raise ValueError("num_tokens must be a contiguous int64 tensor with one entry per row")
    if b and (int(num_tokens.max()) > length or int(num_tokens.min()) < 0):
        raise ValueError(f"num_tokens must be within 0 … {length}")
    u, out, new_window = torch.empty(b, length, d), torch.empty(b, length, d), torch.empty(b, d, taps - 1)
    # Held in locals through the call: the kernel reads their memory.
    proj, taps_by_channel = proj.contiguous(), weight.t().contiguous()  # [W, d]: a tap's weights side by side
    window = None if window is None else window.contiguous()
    native.load().short_conv_prefill(
        native.pointer(proj),
        num_tokens.data_ptr(),
        native.pointer(taps_by_channel),
        native.pointer(bias),
        native.pointer(window),
        native.pointer(u),
        native.pointer(out),
        native.pointer(new_window),
        b,
        length,
        d,
        taps,
        torch.get_num_threads(),
    )
    return out, new_window, u
