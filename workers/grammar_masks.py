"""A step's grammar masks (structured outputs), and drafts cut to what the grammar allows before they are verified.

Order within a step (`workers/step_apply.py`, `workers/scheduler.py`):
1. `legal_drafts`, before the verification forward: each constrained row's drafts cut at the first token its grammar
   rejects (the target then verifies only legal drafts; see docs/speculative-decoding.md for why this is exact);
2. `step_masks`, once the forward is launched and before sampling or acceptance: the masks of every position a token
   is chosen at — position 0 from the request's state, position i after its first i drafts — each matcher rolled
   back after. On CUDA the forward's kernels still run then (the host waits only when it reads the tokens); on CPU
   the forward has returned: xgrammar's fill holds the GIL (a fill thread beside a Python loop took the sum of both
   times), and a worker thread filling during the forward was measured 3 % slower end to end than filling here
   (demo target, batch 32, JSON schema: 0.218 s against 0.212 s, median of 15), so this is the cheapest place.
"""

from __future__ import annotations

import torch

from workers.requests import Request
from workers.spec_decode.proposal import Proposal
from workers.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID


def constrained(requests: list[Request]) -> bool:
    """Whether any of the requests has a grammar."""
    return any(r.grammar is not None for r in requests)


def legal_drafts(requests: list[Request], proposal: Proposal) -> Proposal:
    """The proposal with each constrained row's drafts cut at the first token its grammar rejects (its width cut
    to the longest row left, so a step whose drafts were all cut runs plain)."""
    if not constrained(requests):
        return proposal
    token_ids = proposal.token_ids.clone()  # [num_reqs, max_k]
    for row, request in enumerate(requests):
        if request.grammar is None:
            continue
        drafts = [t for t in token_ids[row].tolist() if t != PLACEHOLDER_TOKEN_ID]
        num_legal = request.grammar.legal_prefix(drafts)
        token_ids[row, num_legal:] = PLACEHOLDER_TOKEN_ID
    width = int((token_ids != PLACEHOLDER_TOKEN_ID).sum(1).max()) if len(requests) else 0
    probs = None if proposal.probs is None else proposal.probs[:, :width]
    return Proposal(token_ids[:, :width], probs, proposal.caught_up)


def fill_masks(requests: list[Request], drafts: list[list[int]] | None, width: int) -> torch.Tensor:
    """[num_reqs, width, words] masks: row i position j after request i's first j drafts; unconstrained rows and
    positions past a row's drafts allow every token."""
    words = next(r.grammar.words for r in requests if r.grammar is not None)
    masks = torch.full((len(requests), width, words), -1, dtype=torch.int32)
    flat = masks.view(-1, words)
    for row, request in enumerate(requests):
        if request.grammar is not None:
            request.grammar.fill_masks(flat, row * width, drafts[row] if drafts is not None else [])
    return masks


def step_masks(requests: list[Request], proposal: Proposal | None = None) -> torch.Tensor | None:
    """The masks of a step over `requests` ([b, width, words]): a verification of `proposal` (already
    `legal_drafts`), or a sampled step (None); None when no request is constrained."""
    if not constrained(requests):
        return None
    return fill_masks(requests, *_drafts(proposal))


def _drafts(proposal: Proposal | None) -> tuple[list[list[int]] | None, int]:
    """(each row's drafts, positions per row: drafts + 1) of a verification; (None, 1) for a sampled step."""
    if proposal is None:
        return None, 1
    rows = proposal.token_ids.tolist()
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in rows], proposal.token_ids.shape[1] + 1
