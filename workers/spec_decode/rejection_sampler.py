"""Rejection sampling of draft tokens against the target (Leviathan et al. 2023; Chen et al. 2023).

Output rows have k+1 columns: accepted drafts from column 0, then one recovered token (at the first rejection)
or the bonus token (all drafts accepted), then PLACEHOLDER_TOKEN_ID. Valid tokens are contiguous from column 0, so

    num_accepted_tokens = (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=1)     # 1 … k+1

and the output distribution is exactly the target's, whatever the drafts were.
"""

from __future__ import annotations

import torch

from workers.sampling import PLACEHOLDER_TOKEN_ID, SamplingParams, sample_from, target_probs

__all__ = ["PLACEHOLDER_TOKEN_ID", "num_accepted_tokens", "rejection_sample", "RejectionSampler"]


def num_accepted_tokens(output_token_ids: torch.Tensor) -> torch.Tensor:
    """[num_reqs, k+1] → [num_reqs]: accepted drafts + 1 (the recovered or bonus token)."""
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=1)


def _uniform(generator: torch.Generator) -> float:
    """u ~ U(0, 1] in float64, never exactly 0."""
    return 1.0 - float(torch.rand((), dtype=torch.float64, generator=generator, device=generator.device))


def _sample_row(draft: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """Accept d_i with probability min(1, p(d_i) / q(d_i)); on rejection sample from normalize(max(p − q, 0))."""
    for i, token in enumerate(draft):
        q_token = 1.0 if q is None else float(q[i, token])  # ngram drafts: q is one-hot on the draft
        if _uniform(generator) * q_token <= float(p[i, token]):
            continue
        residual = p[i].clone()
        if q is None:
            residual[token] = 0
        else:
            residual = (residual - q[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q: the rejection had probability 0; keep p
            residual = p[i]
        return draft[:i] + [sample_from(residual / residual.sum(), generator)]
    return draft + [sample_from(p[len(draft)], generator)]


def greedy_accept(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """The greedy rule on the device, without a host round trip: accept drafts while they equal the target's
    argmax, then write the argmax (the correction, or the bonus when all were accepted).

    draft_token_ids [num_reqs, max_k] (PLACEHOLDER_TOKEN_ID after each row's drafts: it never equals an argmax, so
    a row stops there), target_argmax [num_reqs, max_k + 1] → output_token_ids [num_reqs, max_k + 1]."""
    num_reqs, max_k = draft_token_ids.shape
    matches = (draft_token_ids == target_argmax[:, :max_k]).long().cumprod(dim=1)  # 1 while every draft so far matched
    num_accepted_drafts = matches.sum(dim=1, keepdim=True)  # [num_reqs, 1]
    columns = torch.arange(max_k + 1, device=draft_token_ids.device)[None, :]
    placeholder = torch.full((num_reqs, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=draft_token_ids.device)
    drafts = torch.cat([draft_token_ids.long(), placeholder], dim=1)
    corrected = torch.where(columns == num_accepted_drafts, target_argmax, PLACEHOLDER_TOKEN_ID)
    return torch.where(columns < num_accepted_drafts, drafts, corrected)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> torch.Tensor:
    """Verify each request's drafts (k_i ≥ 0 tokens, k_i may differ) against target logits.

    draft_token_ids [num_reqs, max_k]: each row's drafts from column 0, PLACEHOLDER_TOKEN_ID after them.
    target_logits [num_reqs, max_k + 1, v]: row i position j is the target's distribution after draft j.
    draft_probs [num_reqs, max_k, v] (draft-model proposals, already temperature/top-k/top-p adjusted) or None
    (n-gram proposals). Returns output_token_ids [num_reqs, max_k + 1] with PLACEHOLDER_TOKEN_ID padding.
    When every request is greedy nothing leaves the device (`greedy_accept`).
    """
    num_reqs, width, _ = target_logits.shape
    device = target_logits.device
    assert draft_token_ids.device == device and (draft_probs is None or draft_probs.device == device), (
        f"drafts on {draft_token_ids.device}, draft probs on {getattr(draft_probs, 'device', None)}, "
        f"target logits on {device}: every input must be on the target's device"
    )
    if all(p.greedy for p in params):
        return greedy_accept(draft_token_ids, target_logits.argmax(-1))
    output = torch.full((num_reqs, width), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    argmax = target_logits.argmax(-1).tolist()  # [num_reqs, max_k + 1]
    for row, p_row in enumerate(params):
        draft = [t for t in draft_token_ids[row].tolist() if t != PLACEHOLDER_TOKEN_ID]
        k = len(draft)
        if p_row.greedy:
            # Greedy: accept while the draft equals the target argmax; then the argmax is the correction/bonus.
            accepted = next((i for i, token in enumerate(draft) if token != argmax[row][i]), k)
            tokens = draft[:accepted] + [argmax[row][accepted]]
        else:
            p = target_probs(target_logits[row, : k + 1], p_row)
            q = None if draft_probs is None else draft_probs[row, :k]
            tokens = _sample_row(draft, p, q, generators[row])
        output[row, : len(tokens)] = torch.tensor(tokens, device=device)
    return output


class RejectionSampler:
    """Thin callable shell over `rejection_sample` (the object the runner holds, as in vLLM)."""

    __call__ = staticmethod(rejection_sample)
