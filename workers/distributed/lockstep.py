"""Lockstep: one decider (rank 0, the leader), followers that replay its decisions.

Every rank runs the same scheduler code over the same request stream, so admission, prefix-cache hits, slot moves
and forks (deterministic in the tokens) are computed on every rank, never sent. What is not deterministic — the
policy's timing, sampling, acceptance, drafts, grammar masks, stop strings — happens on the leader alone, which sends
each outcome at the point the scheduler reaches it (`Lockstep.decide`, `publish`); the followers take it
(`ReplayApplier`). A per-step fingerprint of the live rows guards against a rank whose state drifted anyway.

At T = 1 `SINGLE_LOCKSTEP` is a pass-through: `decide` returns what it computes and nothing is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.distributed.channel import ABORT, FollowerChannel, LeaderChannel, RankDivergence
from workers.executors import ModuleExecutor, Verification
from workers.model.distributed.group import SINGLE, Collectives, RankFailure
from workers.requests import Request
from workers.spec_decode.proposal import Proposal, Proposer
from workers.step_apply import StepApplier


class Lockstep:
    """This rank's place in its group: the single rank, the leader (sends) or a follower (receives)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Collectives = SINGLE,
        leader: LeaderChannel | None = None,
        follower: FollowerChannel | None = None,
    ):
        """`leader` on rank 0 of a group, `follower` on the others; neither for the single rank."""
        assert (size == 1) == (leader is None and follower is None), "a group of T > 1 ranks needs its channel"
        self.rank, self.size, self.group = rank, size, group
        self.leader, self.follower = leader, follower

    @property
    def leads(self) -> bool:
        """Rank 0 of a group of T > 1 ranks: it decides and sends."""
        return self.leader is not None

    @property
    def follows(self) -> bool:
        """Ranks 1 … T-1: they replay the leader's decisions."""
        return self.follower is not None

    def publish(self, tag: str, value: Any = None) -> None:
        """Leader: send `(tag, value)` to the followers (nothing elsewhere)."""
        if self.leader is not None:
            self.leader.send(tag, value)

    def receive(self, tag: str) -> Any:
        """Follower: the value of the leader's next message, which must be `tag`."""
        assert self.follower is not None
        return self.follower.recv(tag)

    def abort(self, error: BaseException) -> None:
        """Leader: its step failed part-way with `error`; the followers drop theirs. When `error` is a collective's
        `RankFailure`, what a follower reported before it went (its divergence, its error) is raised instead."""
        if self.leader is None or error is self.leader.failure:
            return  # the channel's own failure: nothing better to say, nobody to tell
        try:
            self.leader.send(ABORT)
        except RankFailure as report:
            if isinstance(error, RankFailure):
                raise report from error

    def decide(
        self,
        tag: str,
        compute: Callable[[], Any],
        fingerprint: Callable[[], Any] | None = None,
        replay: Callable[[], Any] | None = None,
        wire: Callable[[Any], Any] | None = None,
    ) -> Any:
        """The leader's `compute()` on every rank. Leader: computes it and sends it (through `wire`, which drops
        what followers need not see) with its `fingerprint()`. Follower: runs `replay()` (work whose collectives
        the leader's `compute` runs too), receives the value, and raises `RankDivergence` when its own
        `fingerprint()` differs from the leader's."""
        if self.size == 1:
            return compute()
        if self.follower is not None:
            if replay is not None:
                replay()
            value, theirs = self.follower.recv(tag)
            mine = fingerprint() if fingerprint is not None else None
            if mine != theirs:
                raise RankDivergence(f"rank {self.rank} diverged at {tag!r}: leader {theirs}, this rank {mine}")
            return value
        value = compute()
        self.publish(tag, (value if wire is None else wire(value), fingerprint() if fingerprint else None))
        return value

    def agree_failure(self, failure: str | None) -> str | None:
        """A plan that failed to build on any rank fails on all (every rank then runs module by module)."""
        if self.size == 1:
            return failure
        ok = self.group.all_reduce_min([int(failure is None)])[0]
        return failure if failure is not None or ok else "the plan failed to build on another rank"


SINGLE_LOCKSTEP = Lockstep()


def fingerprint(requests: list[Request]) -> tuple[tuple[int, int, int, int], ...]:
    """The live rows as this rank sees them after `schedule()`: (index, slot, num_computed, num_tokens) each."""
    return tuple((r.index, r.slot, r.num_computed, r.num_tokens) for r in requests)


def without_probs(proposal: Proposal | None) -> Proposal | None:
    """A proposal as followers need it: the draft ids (the draft distributions stay on the leader's device)."""
    return None if proposal is None else Proposal(proposal.token_ids, None, proposal.caught_up)


def append_decided(request: Request, token_ids: list[int], finish_reason: str | None) -> None:
    """A follower's request takes the tokens and the finish the leader decided (no tokenizer, no grammar here)."""
    request.output.extend(token_ids)
    request.finish_reason = finish_reason


class ReplayApplier(StepApplier):
    """A follower's apply step: the leader's tokens and accepted counts instead of sampling and acceptance; the
    state shift, the proposer's bookkeeping and the hidden states a proposer drafts from run as on the leader."""

    def __init__(self, proposer: Proposer | None, lockstep: Lockstep, logprobs_mode: str):
        super().__init__(None, proposer, None, None, logprobs_mode)  # type: ignore[arg-type]
        self.lockstep = lockstep

    def sampled(self, requests: list[Request], logits: torch.Tensor) -> None:
        """The leader's sampled token and finish for every row."""
        for request, (token, finish_reason) in zip(requests, self.lockstep.receive("sampled")):
            append_decided(request, [token], finish_reason)

    def verified(
        self, requests: list[Request], proposal: Proposal, verification: Verification, executor: ModuleExecutor
    ) -> list[int]:
        """Shift to the leader's accepted counts, then append its tokens; returns num_accepted_tokens per row."""
        accepted, outcomes = self.lockstep.receive("verified")
        counts = None
        if verification.old_states is not None:
            counts = torch.tensor(accepted, device=executor.device)
        hidden = executor.keep(requests, verification, accepted, counts)
        self.observe(requests, hidden, verification.cache_lens, accepted)
        self.proposer.accepted(requests, accepted)
        for request, (token_ids, finish_reason) in zip(requests, outcomes):
            append_decided(request, token_ids, finish_reason)
        return accepted

    def shadow_drafts(self, requests: list[Request], shadow: dict[int, tuple[int, int]]) -> None:
        """Nothing: the leader's policy alone learns from drafts."""


class ReplayProposer(Proposer):
    """A follower's stand-in for a proposer that runs on the leader alone (a draft model, loaded unsharded on
    rank 0): the leader's drafts arrive with the `proposal` decision, and there is no state to shift."""
