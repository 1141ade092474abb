"""Attention of a prefill chunk over a long cache without materialising [l, span] scores or masks.

A chunk of l new tokens at positions P … P+l-1 attends to the cache positions 0 … P+l-1 causally: every query sees
the whole cached prefix 0 … P-1, and the chunk itself under a square causal mask. A boolean (or lower-right causal)
mask over the full span makes SDPA on CPU build an [l, span] float mask — 2 GB for a 2,048-token chunk at 256k.
Instead the two parts run through a flash-attention kernel each (no mask at all, and the square `is_causal` case,
both computed block by block) and are merged exactly through their log-sum-exps:

    out = (o₁ · e^(lse₁ − m) + o₂ · e^(lse₂ − m)) / (e^(lse₁ − m) + e^(lse₂ − m)),   m = max(lse₁, lse₂).

For the unmasked prefix, grouped-query heads are folded into the query length ([kv_heads, group · l] queries), so
keys are never repeated per query head. Off the CPU, SDPA's lower-right causal bias reaches its fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

LONG_ATTENTION_SCORES = 1 << 22  # l · span above which a single row's chunk takes this path


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, ...]:
    """(out [1, H, l, hd], log-sum-exp [1, H, l] float32) from PyTorch's CPU flash-attention kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def long_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, length: int
) -> torch.Tensor:
    """q [1, H, l, hd] for the last l positions of keys/values [1, KV, span, hd] → [1, H, length, hd] (rows past l,
    padding, are zero)."""
    _, num_heads, num_new, head_dim = q.shape
    num_kv_heads, span = keys.shape[1], keys.shape[2]
    group, prefix = num_heads // num_kv_heads, span - num_new
    if q.device.type != "cpu":
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=causal_lower_right(num_new, span), scale=scale, enable_gqa=group > 1
        )
    else:
        # 1. The chunk over itself: square causal mask (keys repeated per query head: only l of them).
        chunk_keys = keys[:, :, prefix:].repeat_interleave(group, dim=1)
        chunk_values = values[:, :, prefix:].repeat_interleave(group, dim=1)
        out, lse = _flash_cpu(q, chunk_keys.contiguous(), chunk_values.contiguous(), True, scale)
        if prefix > 0:
            # 2. The chunk over the cached prefix: no mask; query heads of one KV head side by side.
            folded = q.reshape(1, num_kv_heads, group * num_new, head_dim)
            prefix_keys, prefix_values = keys[:, :, :prefix], values[:, :, :prefix]  # strided views: no copy
            out_prefix, lse_prefix = _flash_cpu(folded, prefix_keys, prefix_values, False, scale)
            out_prefix = out_prefix.reshape(1, num_heads, num_new, head_dim)
            lse_prefix = lse_prefix.reshape(1, num_heads, num_new)
            # 3. Merge the two softmaxes.
            top = torch.maximum(lse, lse_prefix)
            w_chunk, w_prefix = (lse - top).exp()[..., None], (lse_prefix - top).exp()[..., None]
            out = ((out.float() * w_chunk + out_prefix.float() * w_prefix) / (w_chunk + w_prefix)).to(q.dtype)
    if num_new < length:
        out = F.pad(out, (0, 0, 0, length - num_new))
    return out
