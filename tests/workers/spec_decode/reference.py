"""The target's next-token logits from one plain forward: the reference the sampled speculative tests compare with
(independent of the runner's step code)."""

from __future__ import annotations

import torch

from workers import ModelRunner
from workers.model import ForwardBatch, StatePool
from workers.requests import Request
from workers.spec_decode.proposal import Proposal, Proposer


def last_position_logits(runner: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
    """Logits [len(sequences), v] after each sequence, from fresh states (right-padded, one forward)."""
    lengths = [len(s) for s in sequences]
    ids = torch.tensor([s + [0] * (max(lengths) - len(s)) for s in sequences])
    pool = StatePool(runner.config, len(sequences), max(lengths), torch.device("cpu"), torch.float32)
    batch = ForwardBatch(
        torch.arange(len(sequences)), torch.zeros(len(sequences), dtype=torch.long), torch.tensor(lengths)
    )
    with torch.no_grad():
        hidden = runner.model(ids, batch, pool.zeros(len(sequences)), pool.kv_caches()).hidden
    return runner.model.logits(hidden[torch.arange(len(sequences)), torch.tensor(lengths) - 1])


class PatternProposer(Proposer):
    """Drafts each prompt's reference continuation (`reference`: prompt → tokens, e.g. plain greedy's), corrupted
    from a scripted position on: `pattern` "all" (every draft right), "none" or "some" (one or two right, by turns).
    Whatever is accepted, a speculative run must reproduce the reference."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], pattern: str):
        self.reference, self.pattern, self.step = reference, pattern, 0

    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        """The reference's next `k` tokens per request, wrong from the scripted position on."""
        self.step += 1
        drafts = []
        for request, k in zip(requests, num_drafts):
            ref = self.reference[tuple(request.prompt)][len(request.output) : len(request.output) + k]
            correct = {"all": len(ref), "none": 0, "some": min(len(ref), 1 + self.step % 2)}[self.pattern]
            drafts.append(ref[:correct] + [(t + 1 + self.step % 3) % 128 for t in ref[correct:]])
        return Proposal.from_lists(drafts, None)
