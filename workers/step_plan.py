"""The values that pass between the parts of a step: the scheduler's decision (`StepPlan`, vLLM v1's
`SchedulerOutput`) and what the speculation policy learns from the step (`StepOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.requests import Request


@dataclass(frozen=True)
class DraftPlan:
    """How many drafts each generating row verifies this step, decided before anything runs."""

    num_drafts: list[int]  # k_i per generating row (all 0: a plain step; the proposer is not asked)
    # Drafts a free proposer (n-gram lookup) already made, per row (None: a model proposer makes them when asked).
    looked_up: list[list[int]] | None = None
    # Row → (position, draft): a looked-up first draft the step runs plain, checked against the token the step
    # produces at that position ("shadow" drafts: acceptance evidence on plain steps).
    shadow: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPlan:
    """One step, decided: which rows prefill which chunk, which rows generate, and how many drafts each verifies."""

    prefill: list[Request]  # rows that prefill this step, in admission order …
    chunks: list[int]  # … and the prompt tokens each takes
    generating: list[Request]  # rows that decode one token, or verify their drafts
    drafts: DraftPlan | None  # None: no proposer (plain decoding)


@dataclass(frozen=True)
class StepOutcome:
    """What a speculative step tells the policy: drafts asked for and accepted per request (a draft a model proposer
    could not make counts as rejected), the drafts the verification ran per row (the width its time is filed
    under), and whether the step's time stands for that width (not when the proposer caught up on a prompt)."""

    request_ids: list[int]
    num_drafts: list[int]
    num_accepted_drafts: list[int]
    width: int
    timed: bool
