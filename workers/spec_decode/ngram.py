"""Prompt-lookup (n-gram) proposer: continue the most recent earlier occurrence of the context's last n-gram."""

from __future__ import annotations

from workers.model import StatePool
from workers.requests import Request
from workers.spec_decode.proposal import Proposal, Proposer


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` drafts for a request whose prompt + generated tokens are `token_ids`.

    Tries n-grams from `max_n` down to `min_n`: the last n tokens are looked up in the earlier context (most
    recent match first) and the tokens that followed it are proposed. A match closer to the end than
    `num_tokens` copies on through its own proposal, like an overlapping LZ77 copy: in a loop of period p
    (`#\n#\n…`, `with_with_…`) the continuation repeats the period instead of stopping after p tokens. No match
    → no drafts (the step is then a plain decode step, which must stay exact).
    """
    if num_tokens <= 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                follow: list[int] = []
                for i in range(start + n, start + n + num_tokens):  # past the end: the copy's own output
                    follow.append(token_ids[i] if i < length else follow[i - length])
                return follow
    return []


class NgramIndex:
    """One request's tokens and the most recent start of each of their n-grams (min_n ≤ n ≤ max_n), grown as tokens
    come: a lookup costs max_n − min_n + 1 dict reads instead of `propose_ngram`'s scan of the whole context (which,
    in Python, cost a batch-32 step more than the plain forward of the demo model). Same drafts as `propose_ngram`."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], int] = {}  # n-gram → latest start s with a token after it (s + n < len)

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens and index the n-grams they complete."""
        tokens, first = self.tokens, max(1, len(self.tokens))
        tokens.extend(new_tokens)
        for end in range(first, len(tokens)):  # token `end` follows the n-grams that end before it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.starts[tuple(tokens[end - n : end])] = end - n

    def copy(self) -> NgramIndex:
        """An independent index of the same tokens (a fork's)."""
        other = NgramIndex(self.min_n, self.max_n)
        other.tokens, other.starts = list(self.tokens), dict(self.starts)
        return other

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts to follow the tokens so far, as `propose_ngram` would propose."""
        tokens, length = self.tokens, len(self.tokens)
        if num_tokens <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(tokens[length - n :]))
            if start is not None:
                follow: list[int] = []
                for i in range(start + n, start + n + num_tokens):  # past the end: the copy's own output
                    follow.append(tokens[i] if i < length else follow[i - length])
                return follow
        return []


class NgramProposer(Proposer):
    """Prompt-lookup proposer (no draft distribution: the rejection sampler treats q as one-hot); its only state is
    each slot's `NgramIndex`."""

    drafts_cost_nothing = True  # the scheduler may ask for drafts it will not verify (acceptance evidence)

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[int, NgramIndex] = {}  # slot → its request's index

    def start(self, pool: StatePool, max_chunk_tokens: int) -> None:
        """A new batch: no request indexed yet."""
        self.indexes.clear()

    def move(self, source: int, target: int) -> None:
        """The request's index follows it to its new slot."""
        self.indexes[target] = self.indexes.pop(source)

    def admit(self, requests: list[Request]) -> None:
        """New requests start with an empty index (filled at their first proposal)."""
        for request in requests:
            self.indexes[request.slot] = NgramIndex(self.min_n, self.max_n)

    def fork(self, source: Request, targets: list[Request]) -> None:
        """Each sample of a prompt starts from a copy of its index."""
        index = self.indexes.get(source.slot)
        for target in targets:
            self.indexes[target.slot] = NgramIndex(self.min_n, self.max_n) if index is None else index.copy()

    def lookup(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Up to num_drafts[i] tokens for each request, as lists; fewer (even 0) when the context has no match."""
        drafts = []
        for request, k in zip(requests, num_drafts):
            index = self.indexes.get(request.slot)
            if index is None:
                index = self.indexes[request.slot] = NgramIndex(self.min_n, self.max_n)
            seen = len(index.tokens)
            if seen < request.num_tokens:
                index.extend(request.prompt[seen:] + request.output[max(0, seen - len(request.prompt)) :])
            drafts.append(index.propose(k))
        return drafts

    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        """`lookup`'s drafts as a `Proposal`."""
        return Proposal.from_lists(self.lookup(requests, num_drafts), None)

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        """Nothing to shift: the index only ever grows with the request's own tokens."""
