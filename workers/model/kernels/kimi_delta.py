"""The Kimi delta rule (KDA) in pure PyTorch: one-step recurrence, token-by-token scan, chunked scan, state after a
prefix. The gated delta rule of `gated_delta.py` with a decay per key channel instead of one per head.

Per head, with state S [d_k, d_v] (float32), log decay g ≤ 0 per key channel [d_k] and write strength beta:
    S ← diag(exp(g)) · S;   S ← S + k ⊗ beta · (v − Sᵀk);   o = Sᵀq
Shapes: q, k [b, l, h, d_k] (l2-normalised, q scaled by d_k^-0.5); v [b, l, h, d_v]; g [b, l, h, d_k] and
beta [b, l, h] float32; state [b, h, d_k, d_v] float32. A position with g = 0 and beta = 0 leaves the state exactly
as it was: callers zero both at padded positions. Every function takes the state it starts from and returns the
state it ends in; nothing is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_step_(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token per row, updating a contiguous `state` [b, h, d_k, d_v] in place: k, g [b, h, d_k]; v [b, h, d_v];
    beta [b, h]."""
    b, h, d_k, d_v = state.shape
    state.mul_(g.exp()[..., None])  # each key channel decays at its own rate
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # Sᵀk [b, h, d_v]
    delta = (v - predicted) * beta[..., None]
    state.view(b * h, d_k, d_v).baddbmm_(k.reshape(b * h, d_k, 1), delta.reshape(b * h, 1, d_v))  # S += k ⊗ delta
    return state


def kda_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over l positions → (o [b, l, h, d_v], state after the last position). The reference."""
    outputs = torch.empty(*v.shape[:3], state.shape[-1], dtype=torch.float32, device=v.device)  # [b, l, h, d_v]
    state = state.contiguous().clone()  # the caller's state stays as it was
    for t in range(q.shape[1]):
        kda_step_(k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outputs[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)
    return outputs, state


def kda_state_after(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor,
    num_steps: int | None = None,
) -> torch.Tensor:
    """The state after each row's first num_tokens [b] positions (no outputs); steps past a row's count are no-ops
    (g = beta = 0). `num_steps`: how many steps to run (default: the largest count, read on the host); any number
    ≥ it gives the same state."""
    valid = torch.arange(k.shape[1], device=k.device)[None, :] < num_tokens[:, None]  # [b, l]
    g, beta = g * valid[..., None, None], beta * valid[..., None]
    state = state.contiguous().clone()
    if num_steps is None:
        num_steps = int(num_tokens.max()) if num_tokens.numel() else 0
    for t in range(num_steps):
        kda_step_(k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return state


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, l, h, ...] → [b, h, n, chunk, ...], zero-padded to a whole number of chunks."""
    x = x.transpose(1, 2)
    pad = (-x.shape[2]) % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk_size, *x.shape[3:])


def chunked_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as `kda_scan`, a chunk of positions at a time (the WY form, per key channel).

    Inside a chunk starting from S0, with γ_i = g_1 + … + g_i per channel and D_ijc = exp(γ_ic − γ_jc) for j ≤ i:
    the corrections u solve (I + A) u = β v − β (k ∘ exp(γ)) S0 with A_ij = β_i Σ_c k_ic k_jc D_ijc (j < i);
    then o_i = (q_i ∘ exp(γ_i)) S0 + Σ_{j≤i} (Σ_c q_ic k_jc D_ijc) u_j and
    S_C = diag(exp(γ_C)) S0 + Σ_j (k_j ∘ exp(γ_C − γ_j)) ⊗ u_j. D is built per chunk ([C, C, d_k] per head): every
    exponent is ≤ 0, so no factor overflows however fast a channel decays.
    """
    b, length, h, _ = k.shape
    chunk_size = min(chunk_size, -(-length // 8) * 8)  # a short input: one chunk, padded to a multiple of 8 only
    # 1. Chunk everything: [b, h, n, C, ...]; padding positions have g = beta = 0 (no-ops).
    q, k, v, g = (_to_chunks(x.float(), chunk_size) for x in (q, k, v, g))
    beta = _to_chunks(beta.float(), chunk_size)
    gamma = g.cumsum(dim=-2)  # [b, h, n, C, d_k]
    strict = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk_size, device=q.device)
    outputs = torch.empty_like(v)
    # 2. Chunks in sequence, carrying the state.
    for c in range(q.shape[2]):
        gc, kc, qc, bc = gamma[:, :, c], k[:, :, c], q[:, :, c], beta[:, :, c, :, None]
        # D [b, h, C, C, d_k]; positions above the diagonal get exp(−inf) = 0.
        decay = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~causal[..., None], -torch.inf).exp()
        pair = kc[..., None, :, :] * decay  # k_jc D_ijc
        system = eye + ((kc[..., :, None, :] * pair).sum(-1) * bc).masked_fill(~strict, 0.0)
        rhs = bc * v[:, :, c] - bc * ((kc * gc.exp()) @ state)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [b, h, C, d_v]
        scores = (qc[..., :, None, :] * pair).sum(-1)  # [b, h, C, C], 0 above the diagonal
        outputs[:, :, c] = (qc * gc.exp()) @ state + scores @ u
        last = gc[..., -1:, :]  # [b, h, 1, d_k]
        state = state * last.transpose(-1, -2).exp() + (kc * (last - gc).exp()).transpose(-1, -2) @ u
    out = outputs.reshape(b, h, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state
