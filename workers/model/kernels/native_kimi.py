"""Python entry points of Kimi-Linear's native kernels (csrc/kda_decode.c, csrc/mla_attention.c): argument checks,
output allocation, one ctypes call each. The PyTorch paths in layers/kda.py and layers/mla.py are the reference.

KDA: `proj` is in_proj's output, rows [q | k | v | f_a | g_a | b] (3·h·d + 2·d + h), `f` = f_b_proj(f_a) and
`gate` = g_b_proj(g_a), each h·d wide: the two small linears between in_proj and the kernel stay linears.
"""

from __future__ import annotations

import torch

from workers.model.kernels import native

RecurrentStateLike = tuple[torch.Tensor, torch.Tensor]  # (conv window, delta-rule state)


def _kda_sizes(proj: torch.Tensor, conv_weight: torch.Tensor, num_heads: int) -> tuple[int, int, int]:
    """(h, d, W) of a KDA mixer from its in_proj output's width and conv weight [3·h·d, W], or ValueError."""
    conv_dim, width = conv_weight.shape
    head_dim = conv_dim // (3 * num_heads)
    if conv_dim != 3 * num_heads * head_dim or proj.shape[-1] != conv_dim + 2 * head_dim + num_heads:
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, conv_weight {tuple(conv_weight.shape)}")
    return num_heads, head_dim, width


def kda_decode_step(
    proj: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    delta_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """One token per row through a KDA mixer's convs, delta rule and gated norm; states are updated in place.

    proj [b, 3·h·d + 2·d + h]; f, gate [b, h·d]; conv_state [b, 3·h·d, W-1]; conv_weight [3·h·d, W];
    delta_state [b, h, d, d]. Returns the o_proj input [b, h·d]. All float32, contiguous, on CPU.
    """
    b, num_heads = delta_state.shape[:2]
    h, d, width = _kda_sizes(proj, conv_weight, num_heads)
    if (
        proj.shape[0] != b
        or f.shape != (b, h * d)
        or gate.shape != (b, h * d)
        or conv_state.shape != (b, 3 * h * d, width - 1)
        or delta_state.shape != (b, h, d, d)
    ):
        raise ValueError(
            f"shape mismatch: proj {tuple(proj.shape)}, f {tuple(f.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"delta_state {tuple(delta_state.shape)}"
        )
    qkv, out = torch.empty(b, 3 * h * d), torch.empty(b, h * d)
    native.load().kda_decode_step(
        *(native.pointer(t) for t in (proj, f, gate, conv_state, conv_weight, dt_bias, A_log, delta_state)),
        native.pointer(norm_weight),
        eps,
        native.pointer(qkv),
        native.pointer(out),
        b,
        h,
        d,
        width,
        torch.get_num_threads(),
    )
    return out


def _check_token_major(
    proj: torch.Tensor, f: torch.Tensor, state: RecurrentStateLike, conv_weight: torch.Tensor
) -> tuple[int, ...]:
    """(l, b, h, d, W) of token-major KDA inputs proj [l, b, ·], f [l, b, h·d] over states ([b, 3·h·d, W-1],
    [b, h, d, d]), or ValueError."""
    length, b = proj.shape[:2]
    h, d, width = _kda_sizes(proj, conv_weight, state[1].shape[1])
    if (
        f.shape != (length, b, h * d)
        or tuple(state[0].shape) != (b, 3 * h * d, width - 1)
        or tuple(state[1].shape) != (b, h, d, d)
    ):
        raise ValueError(
            f"shape mismatch: proj {tuple(proj.shape)}, f {tuple(f.shape)}, conv_state {tuple(state[0].shape)}, "
            f"delta_state {tuple(state[1].shape)}"
        )
    return length, b, h, d, width


def kda_verify(
    proj: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    delta_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """l tokens per row from the states, which are read and left as they are (`kda_keep` advances them):
    token-major proj [l, b, 3·h·d + 2·d + h], f and gate [l, b, h·d] → the o_proj input [l, b, h·d], bit for bit
    what l decode steps give."""
    length, b, h, d, width = _check_token_major(proj, f, (conv_state, delta_state), conv_weight)
    if gate.shape != f.shape:
        raise ValueError(f"shape mismatch: gate {tuple(gate.shape)}, f {tuple(f.shape)}")
    qkv, out = torch.empty(length, b, 3 * h * d), torch.empty(length, b, h * d)
    native.load().kda_verify(
        *(native.pointer(t) for t in (proj, f, gate, conv_state, conv_weight, dt_bias, A_log, delta_state)),
        native.pointer(norm_weight),
        eps,
        native.pointer(qkv),
        native.pointer(out),
        b,
        length,
        h,
        d,
        width,
        torch.get_num_threads(),
    )
    return out


def kda_keep(
    proj: torch.Tensor,
    f: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    delta_state: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Advance each row's states in place by its first accepted[r] (0 … l) tokens of token-major proj [l, b, ·] and
    f [l, b, h·d]: the states accepted[r] decode steps leave, bit for bit."""
    length, b, h, d, width = _check_token_major(proj, f, (conv_state, delta_state), conv_weight)
    accepted = accepted.to(torch.int64).contiguous()
    if accepted.shape != (b,) or (b and (int(accepted.min()) < 0 or int(accepted.max()) > length)):
        raise ValueError(f"accepted counts must be 0 … {length} for each of {b} rows, got {accepted.tolist()}")
    qkv = torch.empty(length, b, 3 * h * d)
    native.load().kda_keep(
        *(native.pointer(t) for t in (proj, f, conv_state, conv_weight, dt_bias, A_log, delta_state, qkv)),
        accepted.data_ptr(),
        b,
        length,
        h,
        d,
        width,
        torch.get_num_threads(),
    )


def kda_prefill(
    proj: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_heads: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (or the next chunk of them) through a KDA mixer's convs, delta rule and gated norm, from the zero
    state or from `initial` (conv window [b, 3·h·d, W-1], delta-rule state [b, h, d, d]).

    proj [b, l, 3·h·d + 2·d + h], f and gate [b, l, h·d] (right-padded; num_tokens [b] int64 valid tokens per row).
    Returns (out [b, l, h·d], conv_state, delta_state, qkv [b, l, 3·h·d]): the o_proj input (0 at padding), the
    states after each row's last valid token, and the conv output after SiLU with q and k l2-normalised (q scaled
    by d^-0.5; 0 at padding).
    """
    b, length, _ = proj.shape
    h, d, width = _kda_sizes(proj, conv_weight, num_heads)
    if f.shape != (b, length, h * d) or gate.shape != (b, length, h * d):
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, f {tuple(f.shape)}, gate {tuple(gate.shape)}")
    if not (num_tokens.dtype == torch.int64 and num_tokens.is_contiguous() and num_tokens.shape == (b,)):
        raise ValueError("num_tokens must be a contiguous int64 tensor with one entry per row")
    if b and (int(num_tokens.max()) > length or int(num_tokens.min()) < 0):
        raise ValueError(f"num_tokens must be within 0 … {length}")
    state_shape, conv_shape = (b, h, d, d), (b, 3 * h * d, width - 1)
    if initial is not None and (initial[0].shape != conv_shape or initial[1].shape != state_shape):
        raise ValueError(f"shape mismatch: initial conv {tuple(initial[0].shape)}, state {tuple(initial[1].shape)}")
    qkv, out = torch.empty(b, length, 3 * h * d), torch.empty(b, length, h * d)
    conv_state, delta_state = torch.empty(conv_shape), torch.empty(state_shape)
    initial_conv, initial_delta = (None, None) if initial is None else (t.contiguous() for t in initial)
    native.load().kda_prefill(
        *(native.pointer(t) for t in (proj, f, gate)),
        num_tokens.data_ptr(),
        *(native.pointer(t) for t in (conv_weight, dt_bias, A_log, norm_weight)),
        eps,
        *(native.pointer(t) for t in (initial_conv, initial_delta, qkv, conv_state, delta_state, out)),
        b,
        length,
        h,
        d,
        width,
        torch.get_num_threads(),
    )
    return out, conv_state, delta_state, qkv


def check_cache_positions(
    tables: torch.Tensor, block_size: int, slot_ids: torch.Tensor, positions: torch.Tensor, length: int, capacity: int
) -> None:
    """ValueError unless positions[r] … positions[r] + length − 1 of every row's slot lie in the cache and have a
    block (what a cache write needs before it starts)."""
    last = positions + length - 1
    if bool((positions < 0).any()) or bool((last >= capacity).any()):
        raise ValueError(f"positions {positions.tolist()} (+ {length} tokens) outside the cache's {capacity}")
    columns = (positions[:, None] + torch.arange(length)) // block_size  # [b, l]
    if bool((tables[slot_ids[:, None], columns] == 0).any()):
        raise ValueError("a position of the step has no KV block")


def mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_b: torch.Tensor,
    scale: float,
    rope_dim: int,
) -> torch.Tensor:
    """Absorbed latent attention of l tokens per row, token-major: q [l, b, h, nope + rope], kv [l, b, L + rope]
    (kv_a_proj_with_mqa's output) → out [l, b, h · v]; the new entries [rmsnorm(latent) · norm_weight | k_rope] are
    written to `cache` [1, cache_tokens, L + rope] at positions[r] + t (positions [b]: each row's first new token)
    of slot slot_ids[r] first. kv_b [h, nope + v, L]. ValueError (before anything is written) for a position outside
    the cache or without a block."""
    length, b, num_heads, qk_dim = q.shape
    _, nope_plus_v, latent = kv_b.shape
    nope = qk_dim - rope_dim
    if kv.shape != (length, b, latent + rope_dim) or kv_b.shape[0] != num_heads or cache.shape[-1] != latent + rope_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, kv_b {tuple(kv_b.shape)}")
    slot_ids, positions = slot_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    if tables.dtype != torch.int64 or not tables.is_contiguous() or slot_ids.shape != (b,) or positions.shape != (b,):
        raise ValueError("block tables, slot ids and positions must be int64, one slot id and position per row")
    check_cache_positions(tables, block_size, slot_ids, positions, length, tables.shape[1] * block_size)
    out = torch.empty(length, b, num_heads * (nope_plus_v - nope))
    native.load().mla_attention(
        *(native.pointer(t) for t in (q, kv, norm_weight)),
        eps,
        native.pointer(cache),
        tables.data_ptr(),
        tables.shape[1],
        block_size,
        slot_ids.data_ptr(),
        positions.data_ptr(),
        native.pointer(kv_b),
        scale,
        native.pointer(out),
        b,
        length,
        num_heads,
        nope,
        rope_dim,
        latent,
        nope_plus_v - nope,
        torch.get_num_threads(),
    )
    return out
