"""Mamba2 scan kernels in pure PyTorch: causal depthwise conv, chunked SSD, one-step recurrence.

Every function takes the state it starts from and returns the state it ends in; nothing is stored.
Rows of a batch may carry different numbers of valid tokens (`num_tokens`, right padding): the caller zeroes
`dt` at padded positions, which makes those steps exact no-ops on the SSM state (exp(0·A) = 1, x·dt = 0),
and `causal_conv` reads each row's new window at that row's own offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    xbc: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + silu over new tokens, continuing from a window of the previous W-1 inputs.

    xbc [b, l, c]; conv_state [b, c, W-1]; weight [c, W]; num_tokens [b] valid tokens per row.
    Returns (out [b, l, c], new_conv_state [b, c, W-1]): the new window is the last W-1 entries of
    `[old window, xbc_0 … xbc_{num_tokens-1}]`, so a row with 0 tokens keeps its window.
    """
    # 1. Append the new inputs to the old window: [b, c, W-1+l].
    window = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
    # 2. Valid convolution over the extended window yields exactly l outputs.
    out = F.silu(F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=xbc.shape[2])).to(xbc.dtype)
    # 3. Each row's new window ends at its last valid input.
    return out.transpose(1, 2), _window_at(window, num_tokens, conv_state)


def _window_at(window: torch.Tensor, num_tokens: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """The W-1 columns of window [b, c, W-1+l] that end at each row's input num_tokens-1."""
    b, c, _ = window.shape
    width_minus_one = conv_state.shape[-1]
    index = num_tokens.view(b, 1, 1) + torch.arange(width_minus_one, device=window.device).view(1, 1, -1)
    return window.gather(2, index.expand(b, c, width_minus_one)).to(conv_state.dtype)


def conv_window_after(conv_state: torch.Tensor, xbc: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """The conv window after each row's first `num_tokens` inputs of xbc [b, l, c]: the last W-1 of
    `[old window, xbc_0 … xbc_{num_tokens-1}]`, without computing any conv output."""
    window = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
    return _window_at(window, num_tokens, conv_state)


def ssm_state_after(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The SSM state after all l steps, without outputs: h_l = exp(Σa) h_0 + Σ_s exp(a_{s+1..l}) dt_s x_s ⊗ B_s.

    x [b, l, h, p]; dt [b, l, h] (0 at positions to skip); A [h]; B [b, l, g, n]; state [b, h, p, n].
    """
    a_cum = torch.cumsum(A * dt.float(), dim=1)  # [b, l, h]
    total = a_cum[:, -1]  # [b, h]
    weights = torch.exp(total[:, None] - a_cum) * dt.float()  # [b, l, h]
    B = _expand_groups(B.float(), x.shape[2], 2)  # [b, l, h, n]
    update = torch.einsum("blh,blhp,blhn->bhpn", weights, x.float(), B)
    return state * torch.exp(total)[..., None, None] + update


def _expand_groups(t: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """[.., g, n] → [.., h, n]: head i reads group i // (h / g)."""
    return t.repeat_interleave(num_heads // t.shape[dim], dim=dim)


def ssm_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step: h = exp(dt·A) h + dt · x ⊗ B;  y = h · C.

    x [b, h, p]; dt [b, h] (after softplus and clamp); A [h]; B, C [b, g, n]; state [b, h, p, n] float32.
    Returns (y [b, h, p] float32, without the D skip, new_state [b, h, p, n] float32).
    """
    num_heads = x.shape[1]
    dt = dt.float()
    B = _expand_groups(B.float(), num_heads, 1)  # [b, h, n]
    C = _expand_groups(C.float(), num_heads, 1)
    decay = torch.exp(dt * A)[..., None, None]  # [b, h, 1, 1]
    new_state = state * decay + (dt[..., None] * x.float())[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, C)
    return y, new_state


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] → [..., T, T] with out[i, j] = a[j+1] + … + a[i] for j ≤ i, -inf above the diagonal."""
    length = a.shape[-1]
    a = a[..., None].expand(*a.shape, length)
    strictly_lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a.masked_fill(~strictly_lower, 0), dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=0)
    return sums.masked_fill(~lower, -torch.inf)


def _carry_states(
    chunk_states: torch.Tensor, chunk_decay: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """`ssd_chunked` step 4: each chunk's start state (None: a zero start) and the final state, carrying
    S_c = exp(Σa over chunk c) S_{c-1} + chunk_c from `initial_state`. chunk_states [b, c, h, p, n]; chunk_decay
    [b, h, c]."""
    state = None if initial_state is None else initial_state.float()
    starts = []
    for c in range(chunk_states.shape[1]):
        starts.append(state)
        own = chunk_states[:, c]
        state = own if state is None else state * chunk_decay[:, :, c, None, None] + own
    return starts, state


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan over l tokens starting from `initial_state` (Mamba2 `ssd_minimal`).

    x [b, l, h, p]; dt [b, l, h] (after softplus/clamp, 0 at padding); A [h]; B, C [b, l, g, n];
    initial_state [b, h, p, n], or None for the zero state (a prompt's first tokens: its terms are skipped).
    Returns (y [b, l, h, p] float32 without the D skip, final_state [b, h, p, n]).
    Glossary: c chunk index, t/s positions inside a chunk, q the channels of a group's heads (h/g · p).
    Heads of one group share B and C, so C·B products and B/C contractions run per group, never per head.
    """
    b, length, num_heads, head_dim = x.shape
    num_groups, size = B.shape[2], B.shape[3]
    heads_per_group = num_heads // num_groups
    chunk_size = min(chunk_size, length)  # exact for any chunk size: never pad a short input up to a full chunk
    pad = (-length) % chunk_size
    num_chunks = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, num_chunks, chunk_size, *t.shape[2:])

    # 1. Discretise: X = x·dt, a = A·dt; padded positions have dt = 0 and so change nothing.
    dt = dt.float()
    xs = chunks(x.float() * dt[..., None])  # [b, c, t, h, p]
    a = chunks(A * dt).permute(0, 3, 1, 2)  # [b, h, c, t]
    Bs, Cs = chunks(B.float().contiguous()), chunks(C.float().contiguous())  # [b, c, t, g, n]
    a_cum = torch.cumsum(a, dim=-1)  # [b, h, c, t]

    # 2. Inside each chunk: y_t = Σ_{s≤t} (C_t·B_s) exp(a_{s+1..t}) X_s.
    decay_in = torch.exp(_segment_sum(a))  # [b, h, c, t, s]
    cb = torch.einsum("bclgn,bcsgn->bgcls", Cs, Bs)  # [b, g, c, t, s]
    scores = decay_in.view(b, num_groups, heads_per_group, num_chunks, chunk_size, chunk_size) * cb[:, :, None]
    y = torch.einsum("bhcls,bcshp->bclhp", scores.view_as(decay_in), xs)

    # 3. State contributed by each chunk alone, decayed to the chunk's end.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, t]
    weighted = (xs * decay_to_end.permute(0, 2, 3, 1)[..., None]).view(b, num_chunks, chunk_size, num_groups, -1)
    chunk_states = torch.einsum("bctgq,bctgn->bcgqn", weighted, Bs)  # [b, c, g, q, n]
    chunk_states = chunk_states.view(b, num_chunks, num_heads, head_dim, size)

    # 4. Carry states across chunks, starting from the initial state: S_c = exp(Σa over chunk c) S_{c-1} + chunk_c.
    starts, final_state = _carry_states(chunk_states, torch.exp(a_cum[..., -1]), initial_state)

    # 5. Contribution of each chunk's start state to its outputs (none for a zero start).
    if any(start is not None for start in starts):
        zeros = torch.zeros_like(chunk_states[:, 0])
        start_states = torch.stack([zeros if t is None else t for t in starts], dim=1)  # [b, c, h, p, n]
        grouped = start_states.view(b, num_chunks, num_groups, heads_per_group * head_dim, size)
        y_off = torch.einsum("bclgn,bcgqn->bclgq", Cs, grouped).reshape(y.shape)
        y = y + y_off * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]

    y = y.reshape(b, num_chunks * chunk_size, num_heads, head_dim)[:, :length]
    return y, final_state


def ssm_step_(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """`ssm_step` updating `state` in place (no state-sized temporaries); returns y [b, h, p] float32.

    For the plain decode loop, whose old state is never needed again; state must be contiguous float32.
    """
    b, num_heads, head_dim = x.shape
    size = state.shape[-1]
    dt = dt.float()
    B = _expand_groups(B.float(), num_heads, 1).reshape(b * num_heads, 1, size)
    C = _expand_groups(C.float(), num_heads, 1).reshape(b * num_heads, size, 1)
    state.mul_(torch.exp(dt * A)[..., None, None])
    flat = state.view(b * num_heads, head_dim, size)
    flat.baddbmm_((dt[..., None] * x.float()).reshape(b * num_heads, head_dim, 1), B)
    return torch.bmm(flat, C).view(b, num_heads, head_dim)


def conv_step_(
    xbc: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One token through the causal conv, shifting `conv_state` in place; xbc [b, 1, c] → out [b, 1, c]."""
    window = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)  # [b, c, W]
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    conv_state.copy_(window[..., 1:])
    return F.silu(out).to(xbc.dtype)[:, None, :]


def ssm_step_fused_(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """`ssm_step_` written as one elementwise expression + reduction, for `torch.compile` to fuse into a single
    pass over the state (eager, it would allocate temporaries: use `ssm_step_` there)."""
    num_heads = x.shape[1]
    dt = dt.float()
    B = _expand_groups(B.float(), num_heads, 1)[:, :, None, :]  # [b, h, 1, n]
    C = _expand_groups(C.float(), num_heads, 1)[:, :, None, :]
    new = state * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x.float())[..., None] * B
    state.copy_(new)
    return (new * C).sum(-1)


_COMPILED: dict[str, object] = {}


def compiled_ssm_step_() -> object:
    """`ssm_step_fused_` compiled once per process (dynamic shapes: any batch size, no recompiles)."""
    if "ssm_step" not in _COMPILED:
        _COMPILED["ssm_step"] = torch.compile(ssm_step_fused_, dynamic=True)
    return _COMPILED["ssm_step"]
