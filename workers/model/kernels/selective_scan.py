"""Mamba (version 1) selective scan in pure PyTorch: prefill scan, one-step recurrence, state after a prefix.

The reference for the native kernels (`native_mamba1.py`, csrc/mamba1_decode.c), which CPU float32 runs instead.

Glossary: b batch, l length, i channels (d_inner), n state size. Per channel the state is a vector of n:
`h_t = exp(dt_t · A) ⊙ h_{t-1} + (dt_t · x_t) ⊗ B_t`, `y_t = h_t · C_t`, with A [i, n] (per channel *and* state
index, unlike Mamba2's one scalar per head), dt, x [b, l, i] and B, C [b, l, n] shared by every channel.

Every function starts from the state it is given and returns the state it ends in; nothing is stored. A per-channel
A rules out Mamba2's chunked SSD trick (`exp(A · Σdt)` factored through one cumulative sum per head would need
[l, l, i, n] decay tensors, or `exp(-A · Σdt)` factors that overflow), so the prefill runs the recurrence position
by position — the same arithmetic as the decode step — over discretised inputs computed a chunk of positions at a
time. Rows may carry different numbers of valid tokens (right padding): the caller zeroes dt at padded positions,
which makes those steps exact no-ops on the state (exp(0) = 1, 0 · x = 0).
"""

from __future__ import annotations

import torch

# Per-position tensors of one prefill chunk ([b, t, i, n] float32, three of them) stay under about this many
# elements each: long prompts of wide models are discretised a few positions at a time.
CHUNK_ELEMENTS = 1 << 23


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or in its own dtype when that is wider (float64 references)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _discretise(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(dt · A), (dt · x) ⊗ B), each [..., i, n] float32, from x, dt [..., i]; A [i, n]; B [..., n]."""
    dt = _wide(dt)
    decay = torch.exp(dt[..., None] * A)
    update = (dt * _wide(x))[..., None] * _wide(B)[..., None, :]
    return decay, update


def selective_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step: h = exp(dt·A) ⊙ h + (dt·x) ⊗ B;  y = h · C.

    x, dt [b, i] (dt after softplus, float32); A [i, n]; B, C [b, n]; state [b, i, n] float32.
    Returns (y [b, i] float32, without the D skip and the gate, new_state [b, i, n]).
    """
    decay, update = _discretise(x, dt, A, B)
    new_state = state * decay + update
    return _read_out(new_state, C), new_state


def selective_step_(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """`selective_step` updating `state` in place (the decode loop, whose old state is never needed again);
    returns y [b, i] float32."""
    decay, update = _discretise(x, dt, A, B)
    state.mul_(decay).add_(update)
    return _read_out(state, C)


def _read_out(state: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """y = h · C: state [..., i, n], C [..., n] → [..., i] float32."""
    return torch.matmul(state, _wide(C)[..., :, None])[..., 0]


def chunk_length(batch: int, channels: int, state_size: int, limit: int) -> int:
    """Positions per prefill chunk: at most `limit`, and few enough that a chunk's [b, t, i, n] tensors stay near
    `CHUNK_ELEMENTS` elements (at least one position)."""
    return max(1, min(limit, CHUNK_ELEMENTS // max(1, batch * channels * state_size)))


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan over l positions from `initial_state` (None: zeros).

    x, dt [b, l, i] (dt after softplus, float32, 0 at padding); A [i, n]; B, C [b, l, n]; initial_state [b, i, n].
    Returns (y [b, l, i] float32 without the D skip and the gate, final_state [b, i, n] float32). The state after
    each row's last valid token is the final one, since padded steps leave it as it was.
    """
    b, length, channels = x.shape
    size = A.shape[-1]
    state = _wide(x.new_zeros(b, channels, size)) if initial_state is None else _wide(initial_state)
    t = chunk_length(b, channels, size, chunk_size)
    outputs = []
    for start in range(0, length, t):
        stop = min(start + t, length)
        # 1. Discretise the chunk's positions at once: [b, t, i, n] each.
        decay, update = _discretise(x[:, start:stop], dt[:, start:stop], A, B[:, start:stop])
        # 2. The recurrence, position by position; the per-position states overwrite `update`.
        for s in range(stop - start):
            state = state * decay[:, s] + update[:, s]
            update[:, s] = state
        # 3. Read every position's state out through its C at once.
        outputs.append(_read_out(update, C[:, start:stop]))
    y = torch.cat(outputs, dim=1) if outputs else _wide(x.new_zeros(b, 0, channels))
    return y, state


def selective_state_after(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The state after all l steps from `state`, without outputs (speculative state shifting: dt is 0 past each
    row's accepted inputs, so those steps change nothing). x, dt [b, l, i]; A [i, n]; B [b, l, n]; state [b, i, n].

    Re-runs the l ≤ k + 1 steps with the decode step's arithmetic rather than a closed form: the shifted state is
    then the one plain decoding reaches, to the last bit of each step's rounding."""
    decay, update = _discretise(x, dt, A, B)  # [b, l, i, n]
    state = _wide(state)
    for s in range(x.shape[1]):
        state = state * decay[:, s] + update[:, s]
    return state
