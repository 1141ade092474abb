"""What a proposer hands the verifier, and the interface every proposer implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from workers.model import StatePool
from workers.requests import Request
from workers.sampling import sample_from, target_probs
from workers.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID


@dataclass
class Proposal:
    """Draft tokens for a batch of requests; rows may hold different numbers of drafts (k_i ≥ 0)."""

    token_ids: torch.Tensor  # [num_reqs, max_k] drafts from column 0, PLACEHOLDER_TOKEN_ID after them
    probs: torch.Tensor | None  # [num_reqs, max_k, v] draft distributions q, or None (n-gram: one-hot)
    # The proposer first caught up on a stretch of context longer than a step (a new prompt, or the tokens of steps
    # it skipped): prompt-sized work, so the step's time says nothing about what drafting costs per step.
    caught_up: bool = False

    @classmethod
    def from_lists(cls, drafts: list[list[int]], probs: torch.Tensor | None, caught_up: bool = False) -> Proposal:
        """Pack ragged draft lists into the padded tensor form."""
        width = max((len(d) for d in drafts), default=0)
        token_ids = torch.full((len(drafts), width), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        for row, draft in enumerate(drafts):
            token_ids[row, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        return cls(token_ids, probs, caught_up)

    @property
    def num_draft_tokens(self) -> list[int]:
        """k_i per request."""
        return (self.token_ids != PLACEHOLDER_TOKEN_ID).sum(1).tolist()


def empty_draft_probs(
    num_reqs: int, max_k: int, vocab_size: int, sampled: bool, device: torch.device
) -> torch.Tensor | None:
    """[num_reqs, max_k, v] zeros for the draft distributions q when any request samples (None when all are greedy),
    on the target's device: the rejection sampler subtracts q from the target's p there."""
    return torch.zeros(num_reqs, max_k, vocab_size, device=device) if sampled else None


def choose_draft_token(
    logits: torch.Tensor, request: Request, is_draft: bool, probs: torch.Tensor | None, row: int, step: int
) -> int:
    """The next draft token of a model proposer: argmax for greedy requests, else a sample from q, recorded in
    probs[row, step] for verification. Steps past a request's own budget only keep the batch running; they draw
    nothing from its generator, so its random stream does not depend on the other requests.

    A constrained request drafts from its grammar's masked logits (q masked too: its drafts are legal and exactly
    distributed as recorded), its matcher walking through the drafts until they are checked (`legal_drafts`)."""
    grammar = request.grammar if is_draft else None
    if grammar is not None:
        logits = grammar.mask_draft_logits(logits)
    if request.params.greedy or not is_draft:
        token = int(logits.argmax())
    else:
        q = target_probs(logits, request.params)
        probs[row, step] = q
        token = sample_from(q, request.generator)
    if grammar is not None:
        grammar.walk_draft(token)
    return token


class Proposer:
    """Proposes drafts; a stateful proposer (a draft model) also shifts its own state after verification.

    Every method has a default that does nothing, so a proposer implements only what it keeps. What a proposer
    offers and needs is declared once, in class attributes the scheduler and runner read (never by probing):

    - `drafts_from_hidden` (MTP): it drafts from the target's final-norm hidden states, which the scheduler hands
      to `observe_target` after every target forward; the target is loaded with its MTP head, and the memory plan
      keeps room for the hidden states it holds (`resume_from` / `consume_known` serve the prefix cache).
    - `drafts_cost_nothing` (n-gram lookup): `lookup` returns drafts as lists, and the scheduler may ask for drafts
      it will not verify, to observe acceptance on plain steps.
    - `needs_draft_model` (a draft model): the runner loads `SpeculativeConfig.draft_model` beside the target (same
      vocabulary and tokenizer) and hands it to the proposer's builder (`registry.py`); such a proposer keeps state slots of its own.

    A proposer with storage of its own (state slots, KV caches) frees it in `release()`, called before the target's
    workspace is replaced by a larger one (two of each would exceed the memory plan).
    """

    drafts_from_hidden: ClassVar[bool] = False
    drafts_cost_nothing: ClassVar[bool] = False
    needs_draft_model: ClassVar[bool] = False

    def start(self, pool: StatePool, max_chunk_tokens: int) -> None:
        """A new batch of requests in the slots of the target's `pool`; a proposer with its own KV pages it over
        `pool.blocks` (the same positions as the target's). A forward of the proposer's own feeds at most
        `max_chunk_tokens` tokens (the scheduler's token budget), prompts included."""

    def move(self, source: int, target: int) -> None:
        """A live request moved from slot `source` to slot `target` (its state moves with it)."""

    def admit(self, requests: list[Request]) -> None:
        """New requests took these slots: forget whatever the slots held."""

    def prepare_fork(self, source: Request) -> None:
        """`source`'s prompt is complete and about to be forked into other slots (n samples, `workers/samples.py`):
        consume what of it the proposer would consume lazily, once, so that the forks copy it (KV entries
        included: the blocks are copied after this)."""

    def fork(self, source: Request, targets: list[Request]) -> None:
        """`targets` took copies of `source`'s slot (n samples): give their slots copies of its per-slot state."""

    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        """At most num_drafts[i] drafts for each live request."""
        raise NotImplementedError

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        """The last proposal's outcome: num_accepted_tokens per request (accepted drafts + 1)."""

    def lookup(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """`drafts_cost_nothing` proposers: up to num_drafts[i] drafts per request, as lists."""
        raise NotImplementedError(f"{type(self).__name__} does not declare drafts_cost_nothing")

    def observe_target(
        self, requests: list[Request], hidden: torch.Tensor, cache_lens: list[int], num_tokens: list[int]
    ) -> None:
        """`drafts_from_hidden` proposers: the target's final-norm hidden [b, l, d] of a forward whose row i started
        at position cache_lens[i]; its first num_tokens[i] positions are now part of the request."""

    def resume_from(self, request: Request, position: int, hidden: torch.Tensor) -> None:
        """`drafts_from_hidden` proposers: a request restored from the prefix cache resumes at `position`."""

    def consume_known(self, requests: list[Request]) -> None:
        """`drafts_from_hidden` proposers: consume the held hidden states whose next token is known."""

    def release(self) -> None:
        """Free storage of the proposer's own now (the target's workspace is being replaced)."""
