"""Multi-head latent attention (DeepSeek-V2's MLA, as Kimi-Linear uses it: no RoPE) over a latent KV cache.

Per token the cache holds only the compressed latent c = rmsnorm(kv_a(x)[:L]) and the shared key part
k_r = kv_a(x)[L:] — one cache "key" head `[c | k_r]` of width L + R and no value (`AttentionConfig.cache_value_dim`
0), instead of h heads of keys and values. Head i's key is `[W_uk,i c | k_r]` and its value `W_uv,i c`, where
`kv_b` [h, nope + v, L] stacks W_uk,i and W_uv,i. Two exact ways to attend:
- absorbed (few query tokens: decode, verification): fold W_uk into the query, q' = [W_uk,iᵀ q_nope | q_rope],
  score against `[c | k_r]` directly, average the latents, and only then apply W_uv — nothing per cached token is
  up-projected;
- expanded (prompts): up-project the span's latents to per-head keys and values once and attend as usual, cheaper
  when the queries are as many as the keys.
Scores use scale (nope + rope)^-0.5 in both. Scores are computed for blocks of queries so that no [h, l, span]
matrix exceeds `MAX_SCORES` entries. With `native` (CPU float32, set at load) a step of up to `NATIVE_MAX_TOKENS`
query tokens per row — every row's tokens valid — runs the absorbed form in one C call (`csrc/mla_attention.c`: the latent norm, the cache
write and the attention), the call the decode plan records; the einsum path stays the reference.
Tensor parallel (`tp`): built from the rank's local config (h/T heads): q_proj / q_b_proj rows and kv_b by head,
`o_proj` row-parallel (`forward` returns this rank's partial sum; the model all-reduces it). The latent projections,
their norms and the latent cache are whole on every rank (each rank caches the full latent).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.checkpoint.config import HybridConfig, MlaConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule
from workers.model.kernels import native, native_kimi
from workers.model.layers.head_split import column_parallel, head_rows, row_parallel, share
from workers.model.layers.norm import RMSNorm
from workers.model.state import ForwardBatch, KVCache

LATENT_NORM_EPS = 1e-6  # kv_a_layernorm / q_a_layernorm: transformers and the hub code leave them at the default
ABSORB_MAX_TOKENS = 64  # query tokens per row up to which attention runs absorbed (see the module docstring)
MAX_SCORES = 1 << 22  # entries of one block's score matrix [b, h, queries, span]
# Query tokens per row up to which the native kernel runs a step (decode, verification, draft steps): it scores
# each query against the cache with vector dot products, where a prompt's many queries are faster as the
# matrix products of the einsum path.
NATIVE_MAX_TOKENS = 16


class MultiHeadLatentAttention(nn.Module):
    """Causal latent attention whose latents live in a `KVCache` slot per request (one key head, no value)."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the group."""
        super().__init__()
        m: MlaConfig = config.mla
        self.config, self.scale, self.tp = m, m.qk_head_dim**-0.5, tp
        d, h = config.hidden_size, m.num_heads
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=m.bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=m.bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        # kv_b_proj's weight as [h, nope + v, L]: a plain parameter, read per head by the absorbed path.
        self.kv_b = nn.Parameter(torch.zeros(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank))
        self.o_proj = nn.Linear(h * m.v_head_dim, d, bias=m.bias)
        self.absorb_max_tokens = ABSORB_MAX_TOKENS
        self.native = False  # decode and verification steps through the native kernel (set at load)

    def shard_rules(self) -> dict[str, ShardRule]:
        """The query heads' rows and kv_b by head, `o_proj` row-parallel; the latent parts whole."""
        if not self.tp.parallel:
            return {}
        m, tp = self.config, self.tp
        name = "q_proj" if m.q_lora_rank is None else "q_b_proj"
        queries = column_parallel(name, getattr(self, name), head_rows(tp, (m.num_heads * m.qk_head_dim, 0)))
        outputs = row_parallel("o_proj", self.o_proj, share(tp, m.num_heads * m.v_head_dim))
        return queries | outputs | {"kv_b": head_rows(tp, (m.num_heads, 0))}

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] → q [..., h · (nope + rope)]: q_proj, or q_a_proj → q_a_layernorm → q_b_proj."""
        if self.config.q_lora_rank is None:
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def _native_fits(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> bool:
        """Whether this forward runs through the native kernel: few query tokens, all valid, float32 on CPU."""
        length = hidden.shape[1]
        return (
            self.native
            and length <= min(NATIVE_MAX_TOKENS, self.absorb_max_tokens)
            and native.fits(self.kv_b, cache.key)
            and hidden.dtype == torch.float32
            and bool((batch.num_tokens == length).all())
        )

    def _native_forward(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """`forward` through `csrc/mla_attention.c`, token-major as the decode plan runs it."""
        m, b, length = self.config, hidden.shape[0], hidden.shape[1]
        q = self._queries(hidden).view(b, length, m.num_heads, m.qk_head_dim).transpose(0, 1).contiguous()
        kv = self.kv_a_proj_with_mqa(hidden).transpose(0, 1).contiguous()  # [l, b, L + R]
        out = native_kimi.mla_attention(
            q,
            kv,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            cache.key,
            cache.blocks.tables,
            cache.blocks.block_size,
            batch.slot_ids,
            batch.cache_lens,
            self.kv_b,
            self.scale,
            m.qk_rope_head_dim,
        )
        return self.o_proj(out.transpose(0, 1))

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [b, l, d] → (q [b, h, l, nope + rope], cache entries [b, l, L + R] = [rmsnorm(latent) | k_rope])."""
        m = self.config
        b, length, _ = hidden.shape
        q = self._queries(hidden)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        entries = torch.cat([self.kv_a_layernorm(latent.contiguous()), k_rope], dim=-1)
        return q.view(b, length, m.num_heads, m.qk_head_dim).transpose(1, 2), entries

    def _attend(self, q: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [b, h, l, nope + rope] over cached entries [b, 1, span, L + R], query t seeing positions ≤
        positions[:, t] → out [b, l, h · v]."""
        m = self.config
        b, h, length, _ = q.shape
        span = entries.shape[2]
        latent, k_rope = entries[:, 0].split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)  # [b, span, L], [b, span, R]
        w_uk, w_uv = self.kv_b.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)  # [h, nope, L], [h, v, L]
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        absorbed = length <= self.absorb_max_tokens
        if absorbed:  # 1. Keys are the cache entries themselves, values the latents.
            q = torch.cat([torch.einsum("bhln,hnc->bhlc", q_nope, w_uk), q_rope], dim=-1)  # [b, h, l, L + R]
            keys, values = entries, latent[:, None]
        else:  # 1. Per-head keys [k_nope | k_rope] and values from the latents.
            kv = torch.einsum("bsc,hdc->bhsd", latent, self.kv_b)  # [b, h, span, nope + v]
            k_nope, values = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            keys = torch.cat([k_nope, k_rope[:, None].expand(b, h, span, m.qk_rope_head_dim)], dim=-1)
        # 2. Softmax attention, a block of queries at a time, causal per row.
        step = max(1, MAX_SCORES // max(1, b * h * span))
        out = []
        for start in range(0, length, step):
            scores = (q[:, :, start : start + step] @ keys.transpose(-1, -2)).float() * self.scale
            visible = torch.arange(span, device=q.device)[None, None, :] <= positions[:, start : start + step, None]
            weights = scores.masked_fill(~visible[:, None], -torch.inf).softmax(-1).to(values.dtype)
            out.append(weights @ values)
        o = torch.cat(out, dim=2)  # [b, h, l, L] absorbed, [b, h, l, v] expanded
        if absorbed:  # 3. Only now the values' up-projection, once per query.
            o = torch.einsum("bhlc,hvc->bhlv", o, w_uv)
        return o.transpose(1, 2).reshape(b, length, h * m.v_head_dim)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """hidden [b, l, d] → [b, l, d]; writes the new tokens' latents into their slots."""
        if self._native_fits(hidden, batch, cache):
            return self._native_forward(hidden, batch, cache)
        length = hidden.shape[1]
        offsets = torch.arange(length, device=hidden.device)
        positions = batch.cache_lens[:, None] + offsets  # [b, l]
        q, entries = self._project(hidden)
        # 1. Write the valid new latents at their positions in each row's slot.
        rows, cols = (offsets[None, :] < batch.num_tokens[:, None]).nonzero(as_tuple=True)
        new = entries[rows, cols][:, None].to(cache.key.dtype)  # [n, 1, L + R]
        cache.write(batch.slot_ids[rows], positions[rows, cols], new, new[..., :0])
        # 2. Attend over each row's cache up to its own position.
        span = int((batch.cache_lens + batch.num_tokens).max())
        contiguous = None
        if batch.slot_ids.shape[0] == 1:
            contiguous = cache.blocks.contiguous_start(int(batch.slot_ids[0]), span)
        keys, _ = cache.read(batch.slot_ids, span, contiguous)
        return self.o_proj(self._attend(q, keys, positions))

    def forward_static(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """`forward` with shapes fixed by the cache's capacity (no host synchronisation, no data-dependent shapes:
        the form a CUDA graph captures), as `Attention.forward_static`: every row writes all l new latents and
        attends over the slot's whole capacity, masked causally."""
        b, length, _ = hidden.shape
        positions = batch.cache_lens[:, None] + torch.arange(length, device=hidden.device)  # [b, l]
        q, entries = self._project(hidden)
        slots = batch.slot_ids[:, None].expand(b, length).reshape(-1)
        new = entries.reshape(b * length, 1, -1).to(cache.key.dtype)
        cache.write(slots, positions.reshape(-1), new, new[..., :0])
        capacity = cache.blocks.max_blocks_per_slot * cache.blocks.block_size
        keys, _ = cache.read(batch.slot_ids, capacity)
        return self.o_proj(self._attend(q, keys, positions))
