"""Prompt-lookup (n-gram) proposer: continue the most recent earlier occurrence of the context's last n-gram."""

from __future__ import annotations

from workers.model import StatePool
from workers.requests import Request
from workers.spec_decode.proposal import Proposal


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` drafts for a request whose prompt + generated tokens are `token_ids`.

    Tries n-grams from `max_n` down to `min_n`: the last n tokens are looked up in the earlier context (most
    recent match first) and the tokens that followed it are proposed. No match → no drafts (the step is then a
    plain decode step, which must stay exact).
    """
    if num_tokens <= 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                follow = token_ids[start + n : start + n + num_tokens]
                if follow:
                    return follow
    return []


class NgramProposer:
    """Stateless prompt-lookup proposer (no draft distribution: the rejection sampler treats q as one-hot)."""

    drafts_cost_nothing = True  # the scheduler may ask for drafts it will not verify (acceptance evidence)

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def start(self, pool: StatePool, max_chunk_tokens: int) -> None:
        """Nothing to allocate."""

    def move(self, source: int, target: int) -> None:
        """Nothing is kept per slot."""

    def admit(self, requests: list[Request]) -> None:
        """Nothing to set up per request."""

    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        """Up to num_drafts[i] tokens for each request; fewer (even 0) when the context has no match."""
        drafts = [propose_ngram(r.prompt + r.output, k, self.min_n, self.max_n) for r, k in zip(requests, num_drafts)]
        return Proposal.from_lists(drafts, None)

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        """Nothing to shift: the proposer keeps no state."""
