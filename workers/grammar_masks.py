"""A step's grammar masks (structured outputs), built while the model computes the step, and drafts cut to what the
grammar allows before they are verified.

Order within a step (`workers/step_apply.py`, `workers/scheduler.py`):
1. `legal_drafts`: each constrained row's drafts cut at the first token its grammar rejects (the target then
   verifies only legal drafts; a cut n-gram or greedy draft is exact, see docs/speculative-decoding.md);
2. `MaskBuilder.start`: one worker thread fills the masks of every position a token is chosen at — position 0 from
   the request's state, position i after its first i drafts — and rolls each matcher back; it runs during the
   forward (xgrammar's fill holds the GIL for a few µs per call, the forward's kernels release it);
3. `MaskBuilder.take`, before sampling or acceptance: the masks, joined (built now when none were started).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

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


class MaskBuilder:
    """Fills a step's masks on one worker thread (started only when a constrained request runs)."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._pending: tuple[list[Request], Future] | None = None

    def start(self, requests: list[Request], proposal: Proposal | None = None) -> None:
        """Begin the masks of a step over `requests`: a verification of `proposal` (already `legal_drafts`), or a
        sampled step (None)."""
        self._pending = None
        if not constrained(requests):
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._pending = (requests, self._thread.submit(fill_masks, requests, *_drafts(proposal)))

    def take(self, requests: list[Request], proposal: Proposal | None = None) -> torch.Tensor | None:
        """The masks of the step over `requests` ([b, width, words]), or None when none is constrained: the started
        ones, else built now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is requests:
            return pending[1].result()
        if not constrained(requests):
            return None
        return fill_masks(requests, *_drafts(proposal))


def _drafts(proposal: Proposal | None) -> tuple[list[list[int]] | None, int]:
    """(each row's drafts, positions per row: drafts + 1) of a verification; (None, 1) for a sampled step."""
    if proposal is None:
        return None, 1
    rows = proposal.token_ids.tolist()
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in rows], proposal.token_ids.shape[1] + 1
