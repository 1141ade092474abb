"""Feed-forward mixers: gated (SwiGLU) and relu² MLPs, and mixture-of-experts with a shared MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import FeedForwardConfig, HybridConfig
from workers.model.kernels import native


def _activate(h: torch.Tensor, gated: bool, use_native: bool = False) -> torch.Tensor:
    """silu(gate) · up for fused [gate, up] inputs, else relu(h)²."""
    if gated and use_native and native.fits(h):
        return native.silu_mul(h)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.relu(h).square()


class MLP(nn.Module):
    """Dense MLP; `up_proj` holds [gate; up] fused when the MLP is gated."""

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool, bias: bool):
        super().__init__()
        self.gated = gated
        self.up_proj = nn.Linear(hidden_size, intermediate_size * (2 if gated else 1), bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.native = False  # activation through the native kernel (set at load for CPU float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., d]."""
        return self.down_proj(_activate(self.up_proj(hidden), self.gated, self.native))


class Router(nn.Module):
    """Top-k expert choice: softmax (Granite, Qwen) or grouped sigmoid with score bias (Nemotron-H).

    Softmax with `norm_topk_prob` is a softmax over the top-k logits; without it, the top-k of a softmax over all.
    """

    def __init__(self, hidden_size: int, ff: FeedForwardConfig):
        super().__init__()
        self.ff = ff
        self.weight = nn.Parameter(torch.zeros(ff.num_experts, hidden_size))
        if ff.router == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(ff.num_experts), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [t, d] → (weights [t, k] float32, expert ids [t, k])."""
        ff = self.ff
        if ff.router == "softmax":
            logits = F.linear(hidden, self.weight).float()
            if not ff.norm_topk_prob:
                return torch.softmax(logits, dim=-1).topk(ff.experts_per_token, dim=-1)
            top_logits, top_ids = logits.topk(ff.experts_per_token, dim=-1)
            return torch.softmax(top_logits, dim=-1), top_ids
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()  # [t, e]
        choice = scores + self.e_score_correction_bias.float()
        # Keep the best `topk_groups` groups of experts (a group scores the sum of its top-2).
        grouped = choice.view(-1, ff.num_expert_groups, ff.num_experts // ff.num_expert_groups)
        group_ids = grouped.topk(2, dim=-1)[0].sum(-1).topk(ff.topk_groups, dim=-1)[1]
        group_mask = torch.zeros_like(grouped[..., 0]).scatter_(1, group_ids, 1.0).bool()
        choice = grouped.masked_fill(~group_mask[..., None], -torch.inf).view_as(choice)
        top_ids = choice.topk(ff.experts_per_token, dim=-1)[1]
        weights = scores.gather(1, top_ids)
        if ff.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + ff.topk_norm_eps)
        return weights * ff.routed_scaling_factor, top_ids


class MoE(nn.Module):
    """Routed experts plus an always-on shared MLP (Qwen: scaled by sigmoid(shared_gate(x))); experts as [e, out, in]."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        ff = config.feed_forward
        self.gated = ff.gated
        width = ff.latent_size or config.hidden_size
        self.router = Router(config.hidden_size, ff)
        self.experts_up = nn.Parameter(
            torch.zeros(ff.num_experts, ff.expert_intermediate_size * (2 if ff.gated else 1), width)
        )
        self.experts_down = nn.Parameter(torch.zeros(ff.num_experts, width, ff.expert_intermediate_size))
        # No shared MLP when its width is 0 (Jamba's and LFM2-MoE's MoE have none).
        shared_size = ff.shared_expert_intermediate_size
        self.shared = MLP(config.hidden_size, shared_size, ff.gated, ff.bias) if shared_size else None
        self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False) if ff.shared_expert_gate else None
        self.latent_in = nn.Linear(config.hidden_size, ff.latent_size, bias=ff.bias) if ff.latent_size else None
        self.latent_out = nn.Linear(ff.latent_size, config.hidden_size, bias=ff.bias) if ff.latent_size else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., d]."""
        tokens = hidden.reshape(-1, hidden.shape[-1])  # [t, d]
        weights, expert_ids = self.router(tokens)
        x = self.latent_in(tokens) if self.latent_in is not None else tokens
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in expert_ids.unique().tolist():
            token_idx, slot = (expert_ids == expert).nonzero(as_tuple=True)
            h = _activate(F.linear(x[token_idx], self.experts_up[expert]), self.gated)
            out = F.linear(h, self.experts_down[expert]) * weights[token_idx, slot, None].to(h.dtype)
            routed.index_add_(0, token_idx, out.float())
        routed = routed.to(hidden.dtype)
        if self.latent_out is not None:
            routed = self.latent_out(routed)
        if self.shared is None:
            return routed.view_as(hidden)
        shared = self.shared(hidden)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(hidden)) * shared
        return routed.view_as(hidden) + shared
