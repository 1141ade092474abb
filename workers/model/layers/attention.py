"""Grouped-query attention over a slot-indexed KV cache, with NoPE or (partial) RoPE.

Qwen3-Next / Qwen3.5 add an output gate (q_proj rows per head are `[q_h | gate_h]`, output × sigmoid(gate)) and
an RMSNorm over each head of q and k before RoPE; OLMo 2/3 and OLMo-Hybrid one RMSNorm over the whole q (k) projection.
LFM3 adds a per-head output gate from its own projection (`g_proj`), sliding-window layers (a mask; the cache keeps
every position) and proportional RoPE.

Tensor parallel (`tp`): the layer is built from the rank's local config (h/T query heads; kv/T KV heads, or one KV
head replicated on T/kv ranks), and `o_proj` is row-parallel: `forward` returns this rank's partial sum, which the
model all-reduces. OLMo's full-width q/k norm spans the ranks: the sums of squares are all-reduced (one call for
q and k together); `check_divisible` refuses it with replicated KV heads.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import AttentionConfig, HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, kv_heads
from workers.model.distributed.slices import ShardRule, rows
from workers.model.kernels import native
from workers.model.layers.head_split import column_parallel, head_rows, row_parallel
from workers.model.layers.long_attention import LONG_ATTENTION_SCORES, long_attention
from workers.model.layers.norm import RMSNorm
from workers.model.state import ForwardBatch, KVCache


@functools.lru_cache(maxsize=16)
def inverse_frequencies(
    theta: float, rotary_dim: int, device: torch.device, rope_pairs: int | None = None
) -> torch.Tensor:
    """RoPE's per-pair rotation speeds [rotary_dim / 2], float32 (the native kernel reads the same tensor).
    `rope_pairs` (proportional RoPE): only the first pairs turn, the rest have speed 0."""
    speeds = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))
    if rope_pairs is None:
        return speeds
    return torch.where(torch.arange(rotary_dim // 2, device=device) < rope_pairs, speeds, 0.0)


def rotary(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int, rope_pairs: int | None = None
) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of each head (half-split convention); x [b, heads, l, hd], positions [b, l]."""
    inv_freq = inverse_frequencies(theta, rotary_dim, x.device, rope_pairs)
    freqs = positions.float()[..., None] * inv_freq  # [b, l, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [b, 1, l, rotary_dim]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Attention(nn.Module):
    """Causal self-attention whose keys/values live in a `KVCache` slot per request."""

    def __init__(self, config: HybridConfig, attention: AttentionConfig | None = None, tp: TensorParallel = SINGLE_TP):
        """`attention`: this layer's config where it differs from `config.attention` (LFM3's layer types).
        `config` is the rank's local config (`shard_config`); `tp` its place in the group."""
        super().__init__()
        a: AttentionConfig = attention or config.attention
        self.config = a
        self.tp = tp
        q_width = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=a.bias)
        self.k_proj = nn.Linear(config.hidden_size, a.num_kv_heads * a.head_dim, bias=a.bias)
        self.v_proj = nn.Linear(config.hidden_size, a.num_kv_heads * a.head_dim, bias=a.bias)
        output_bias = a.bias if a.output_bias is None else a.output_bias
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, config.hidden_size, bias=output_bias)
        q_norm_size, k_norm_size = a.head_dim, a.head_dim
        if a.qk_norm_full_width:  # OLMo: one norm over all heads' channels
            q_norm_size, k_norm_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.q_norm = RMSNorm(q_norm_size, config.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, config.rms_norm_eps) if a.qk_norm else None
        self.g_proj = nn.Linear(config.hidden_size, a.num_heads, bias=False) if a.head_gate else None
        self.native = False  # decode steps through the native kernel (set at load for CPU float32)

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [b, l, d] → q [b, l, heads, hd], k, v [b, l, kv_heads, hd], gate [b, l, heads · hd] or None."""
        a = self.config
        b, length, _ = hidden.shape
        if a.qk_norm_full_width:  # normalise the whole projections, then split them into heads
            q, k = self._full_width_norms(self.q_proj(hidden), self.k_proj(hidden))
            q, k = q.view(b, length, a.num_heads, a.head_dim), k.view(b, length, a.num_kv_heads, a.head_dim)
            return q, k, self.v_proj(hidden).view(b, length, a.num_kv_heads, a.head_dim), None
        q = self.q_proj(hidden).view(b, length, a.num_heads, -1)
        gate = None
        if a.output_gate:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(b, length, a.num_heads * a.head_dim)
        k = self.k_proj(hidden).view(b, length, a.num_kv_heads, a.head_dim)
        v = self.v_proj(hidden).view(b, length, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.g_proj is not None:  # one gate per head, as a per-channel gate: sigmoid commutes with repeating
            gate = self.g_proj(hidden).repeat_interleave(a.head_dim, dim=-1)
        return q, k, v, gate

    def _full_width_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo's norms over the whole q and k projections; across the ranks, each holding a slice of the
        channels, the float32 sums of squares are all-reduced (one call for both) before the mean."""
        if not self.tp.parallel:
            return self.q_norm(q), self.k_norm(k)
        squares = torch.cat([q.float().pow(2).sum(-1, keepdim=True), k.float().pow(2).sum(-1, keepdim=True)], -1)
        squares = self.tp.group.all_reduce_(squares.contiguous())
        widths = (q.shape[-1] * self.tp.size, k.shape[-1] * self.tp.size)
        normed = []
        for x, norm, total, width in zip((q, k), (self.q_norm, self.k_norm), squares.unbind(-1), widths):
            scale = torch.rsqrt(total[..., None] / width + norm.eps)
            normed.append((norm.weight.float() * (x.float() * scale)).to(x.dtype))
        return normed[0], normed[1]

    def shard_rules(self) -> dict[str, ShardRule]:
        """Query heads (with their gate rows) and KV heads by rank, `o_proj` row-parallel; per-head norms whole."""
        if not self.tp.parallel:
            return {}
        a, tp = self.config, self.tp
        q_width = a.num_heads * a.head_dim
        q_rows = q_width * (2 if a.output_gate else 1)  # each local head's [q_h | gate_h] stays together
        kv_rows = rows(self._kv_share())
        stated = column_parallel("q_proj", self.q_proj, head_rows(tp, (q_rows, 0)))
        stated |= column_parallel("k_proj", self.k_proj, kv_rows)
        stated |= column_parallel("v_proj", self.v_proj, kv_rows)
        stated |= row_parallel("o_proj", self.o_proj, (tp.rank * q_width, q_width))
        if a.qk_norm and a.qk_norm_full_width:
            stated |= {"q_norm.weight": head_rows(tp, (q_width, 0)), "k_norm.weight": rows(self._kv_share())}
        if self.g_proj is not None:
            stated["g_proj.weight"] = head_rows(tp, (a.num_heads, 0))
        return stated

    def _kv_share(self) -> tuple[int, int]:
        """(first row, rows) of k_proj / v_proj this rank holds: its KV heads, or its replicated one."""
        a, tp = self.config, self.tp
        full_kv = a.num_kv_heads * tp.size if a.kv_replicas == 1 else tp.size // a.kv_replicas
        first, count = kv_heads(dataclasses.replace(a, num_kv_heads=full_kv), tp)
        return first * a.head_dim, count * a.head_dim

    def _visible(self, key_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees: causal, and inside the sliding window when the layer has one.
        key_positions [span] against positions [..., 1] → bool [..., span]."""
        mask = key_positions <= positions
        window = self.config.sliding_window
        return mask if window is None else mask & (key_positions > positions - window)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a = self.config
        return rotary(x, positions, a.rope_theta, a.rotary_dim, a.rope_pairs)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention output [b, l, heads · hd] → o_proj (after the output gate when the model has one; through the
        native kernel when the decode steps are native, so that a decode plan's gate computes the same bits)."""
        if gate is None:
            return self.o_proj(out)
        if self.native and native.fits(out, gate):
            return self.o_proj(native.sigmoid_mul(out, gate))
        return self.o_proj(out * torch.sigmoid(gate))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """hidden [b, l, d] → [b, l, d]; writes the new tokens' keys/values into their slots."""
        a = self.config
        b, length, _ = hidden.shape
        if length == 1 and batch.one_token_each:
            return self._decode(hidden, batch, cache)
        offsets = torch.arange(length, device=hidden.device)
        positions = batch.cache_lens[:, None] + offsets  # [b, l]
        q, k, v, gate = self._project(hidden)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if a.rope_theta is not None:
            q, k = self._rotary(q, positions), self._rotary(k, positions)
        # 1. Write the valid new keys/values at their positions in each row's slot.
        rows, cols = (offsets[None, :] < batch.num_tokens[:, None]).nonzero(as_tuple=True)
        cache.write(batch.slot_ids[rows], positions[rows, cols], k[rows, :, cols], v[rows, :, cols])
        # 2. Attend over each row's cache up to its own position (causal; stale entries beyond are masked).
        span = int((batch.cache_lens + batch.num_tokens).max())
        if self._fresh_prompts(batch, k, cache):
            # Every row starts at position 0: its new keys are all it sees, causally. The square causal case skips
            # the blocks above the diagonal that a [l, span] mask makes the CPU kernel compute (2× at 2,048 tokens).
            # A padded row's valid query t sees only keys 0 … t, all valid.
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=a.scale, enable_gqa=a.num_heads != a.num_kv_heads
            )
        elif b == 1 and length * span > LONG_ATTENTION_SCORES and a.sliding_window is None:
            out = self._long(q, cache, batch, span)
        else:
            keys, values = cache.read(batch.slot_ids, span, self._contiguous(cache, batch, span))
            mask = self._visible(torch.arange(span, device=hidden.device), positions[..., None])  # [b, l, span]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask[:, None], scale=a.scale, enable_gqa=a.num_heads != a.num_kv_heads
            )
        return self._output(out.transpose(1, 2).reshape(b, length, a.num_heads * a.head_dim), gate)

    def _fresh_prompts(self, batch: ForwardBatch, k: torch.Tensor, cache: KVCache) -> bool:
        """Whether attention can run on the new keys alone: every row starts its sequence, the layer has no
        sliding window, and the cache stores keys as computed (a narrower cache dtype rounds what decode reads)."""
        same_dtype = cache.key.dtype == k.dtype and cache.value.dtype == k.dtype
        return same_dtype and self.config.sliding_window is None and not bool(batch.cache_lens.any())

    @staticmethod
    def _contiguous(cache: KVCache, batch: ForwardBatch, span: int) -> int | None:
        """A single row's first token index when its positions lie in consecutive blocks (read as views)."""
        if batch.slot_ids.shape[0] != 1:
            return None
        return cache.blocks.contiguous_start(int(batch.slot_ids[0]), span)

    def _long(self, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, span: int) -> torch.Tensor:
        """One row's chunk of queries over a long cache without a [l, span] score or mask matrix (see
        `long_attention`); q [1, heads, l, hd] → [1, heads, l, hd]."""
        keys, values = cache.read(batch.slot_ids, span, self._contiguous(cache, batch, span))
        num_new = int(batch.num_tokens[0])
        return long_attention(q[:, :, :num_new], keys, values, self.config.scale, q.shape[2])

    def _decode(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """`forward` for one new token in every row: direct cache writes, one mask row per request."""
        a = self.config
        b = hidden.shape[0]
        positions = batch.cache_lens  # [b]: each row's new token goes right after its cached ones
        q, k, v, gate = self._project(hidden)  # [b, 1, heads, hd]: one token, so heads can move to dim 1 freely
        q = q.reshape(b, a.num_heads, 1, a.head_dim)
        k, v = k.reshape(b, a.num_kv_heads, 1, a.head_dim), v.reshape(b, a.num_kv_heads, 1, a.head_dim)
        if self.native and native.fits(q, k, v, cache.key, cache.value):
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [b, heads, hd], contiguous
            if a.rope_theta is not None:  # in place, on the fresh projections
                inv_freq = inverse_frequencies(a.rope_theta, a.rotary_dim, q.device, a.rope_pairs)
                native.rope(q, positions, inv_freq, a.rotary_dim)
                native.rope(k, positions, inv_freq, a.rotary_dim)
            out = native.attention_decode(q, k, v, cache, batch.slot_ids, positions, a.scale, a.sliding_window)
            return self._output(out.view(b, 1, a.num_heads * a.head_dim), gate)
        if a.rope_theta is not None:
            q, k = self._rotary(q, positions[:, None]), self._rotary(k, positions[:, None])
        cache.write(batch.slot_ids, positions, k[:, :, 0], v[:, :, 0])
        span = int(positions.max()) + 1
        keys, values = cache.read(batch.slot_ids, span, self._contiguous(cache, batch, span))
        mask = self._visible(torch.arange(span, device=hidden.device), positions[:, None])  # [b, span]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None, None], scale=a.scale, enable_gqa=a.num_heads != a.num_kv_heads
        )
        return self._output(out.view(b, 1, a.num_heads * a.head_dim), gate)

    def forward_static(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """`forward` with shapes fixed by the cache's capacity, not by its contents: no host synchronisation and no
        data-dependent shapes, the form a CUDA graph captures. Every row writes all l new keys/values (positions
        past a row's valid tokens are scratch the cache overwrites later: they must lie inside the capacity) and
        attends over the whole capacity, masked causally. The same results as `forward` up to the rounding of a
        longer masked reduction (exactly equal where the attention kernel skips masked keys' zero weights)."""
        a = self.config
        b, length, _ = hidden.shape
        positions = batch.cache_lens[:, None] + torch.arange(length, device=hidden.device)  # [b, l]
        q, k, v, gate = self._project(hidden)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, l, hd]
        if a.rope_theta is not None:
            q, k = self._rotary(q, positions), self._rotary(k, positions)
        # 1. Write every new key/value at its position of its row's slot (positions without a block of their own
        # write into the null block: finite scratch that every read masks).
        slots = batch.slot_ids[:, None].expand(b, length).reshape(-1)
        k_rows, v_rows = (
            k.transpose(1, 2).reshape(b * length, a.num_kv_heads, -1),
            v.transpose(1, 2).reshape(b * length, a.num_kv_heads, -1),
        )
        cache.write(slots, positions.reshape(-1), k_rows.to(cache.key.dtype), v_rows.to(cache.value.dtype))
        # 2. Attend over a slot's whole capacity (a fixed gather through the block table); entries past each
        # token's own position are masked.
        capacity = cache.blocks.max_blocks_per_slot * cache.blocks.block_size
        keys, values = cache.read(batch.slot_ids, capacity)  # [b, kv_heads, capacity, hd]
        mask = self._visible(torch.arange(capacity, device=hidden.device), positions[..., None])  # [b, l, capacity]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], scale=a.scale, enable_gqa=a.num_heads != a.num_kv_heads
        )
        return self._output(out.transpose(1, 2).reshape(b, length, a.num_heads * a.head_dim), gate)
