"""The gated delta rule in pure PyTorch: one-step recurrence, token-by-token scan, chunked scan, state after a prefix.

Per value head, with state S [d_k, d_v] (float32), decay g ≤ 0 and write strength beta in (0, 1):
    S ← S · exp(g);   S ← S + k ⊗ beta · (v − Sᵀk);   o = Sᵀq
Shapes: q, k [b, l, h, d_k] (l2-normalised, q scaled by d_k^-0.5, key heads already repeated to the h value
heads); v [b, l, h, d_v]; g, beta [b, l, h] float32; state [b, h, d_k, d_v] float32.
A position with g = 0 and beta = 0 leaves the state exactly as it was: callers zero both at padded positions.
Every function takes the state it starts from and returns the state it ends in; nothing is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step_(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token per row, updating a contiguous `state` [b, h, d_k, d_v] in place: k [b, h, d_k]; v [b, h, d_v];
    g, beta [b, h]. In place and as batched matrix products: the state is the large operand (memory-bound)."""
    b, h, d_k, d_v = state.shape
    state.mul_(g.exp()[..., None, None])
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # Sᵀk [b, h, d_v]: what the state already says for this key
    delta = (v - predicted) * beta[..., None]
    state.view(b * h, d_k, d_v).baddbmm_(k.reshape(b * h, d_k, 1), delta.reshape(b * h, 1, d_v))  # S += k ⊗ delta
    return state


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [b, h, d_k]; v [b, h, d_v]; g, beta [b, h] → (o [b, h, d_v], new state)."""
    state = delta_rule_step_(k, v, g, beta, state.contiguous().clone())
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def delta_rule_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over l positions → (o [b, l, h, d_v], state after the last position). The reference."""
    outputs = torch.empty(*v.shape[:3], state.shape[-1], dtype=torch.float32, device=v.device)  # [b, l, h, d_v]
    state = state.contiguous().clone()  # the caller's state stays as it was
    for t in range(q.shape[1]):
        delta_rule_step_(k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outputs[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)
    return outputs, state


def delta_state_after(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    num_tokens: torch.Tensor,
    num_steps: int | None = None,
) -> torch.Tensor:
    """The state after each row's first num_tokens [b] positions (no outputs): the steps past a row's count are
    made no-ops (g = beta = 0). Speculative state shifting re-runs the accepted prefix with this. `num_steps`:
    how many steps to run (default: the largest count, read on the host); any number ≥ it gives the same state."""
    valid = (torch.arange(k.shape[1], device=k.device)[None, :] < num_tokens[:, None])[..., None]  # [b, l, 1]
    g, beta = g * valid, beta * valid
    state = state.contiguous().clone()
    if num_steps is None:
        num_steps = int(num_tokens.max()) if num_tokens.numel() else 0
    for t in range(num_steps):
        delta_rule_step_(k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return state


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, l, h, ...] → [b, h, n, chunk, ...], zero-padded to a whole number of chunks."""
    x = x.transpose(1, 2)
    pad = (-x.shape[2]) % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk_size, *x.shape[3:])


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as `delta_rule_scan`, a chunk of positions at a time (the UT / WY form of DeltaNet).

    Inside a chunk starting from S0, with γ_i = g_1 + … + g_i and D_ij = exp(γ_i − γ_j) for j ≤ i (0 above):
    the corrections u solve (I + A) u = β v − β exp(γ) k S0 with A_ij = β_i D_ij k_i·k_j (j < i);
    then o_i = exp(γ_i) q_i S0 + Σ_{j≤i} D_ij (q_i·k_j) u_j and S_C = exp(γ_C) S0 + Σ_j exp(γ_C − γ_j) k_j ⊗ u_j.
    """
    b, length, h, _ = k.shape
    # 1. Chunk everything: [b, h, n, C, ...]; padding positions have g = beta = 0 (no-ops).
    q, k, v = (_to_chunks(x.float(), chunk_size) for x in (q, k, v))
    g, beta = (_to_chunks(x.float(), chunk_size) for x in (g, beta))
    # 2. Decays within each chunk.
    gamma = g.cumsum(dim=-1)  # [b, h, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -torch.inf).exp()  # D [.., C, C]
    # 3. The triangular system, solved once for all chunks.
    k_beta = k * beta[..., None]
    system = torch.eye(chunk_size, device=q.device) + ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    u_from_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_per_state = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # [b, h, n, C, C]
    q_from_start = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [b, h, n, 1, 1]
    # 4. Chunks in sequence, carrying the state.
    outputs = torch.empty_like(v)
    for c in range(q.shape[2]):
        u = u_from_v[:, :, c] - u_per_state[:, :, c] @ state  # [b, h, C, d_v]
        outputs[:, :, c] = q_from_start[:, :, c] @ state + scores[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = outputs.reshape(b, h, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state
