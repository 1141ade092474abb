"""Speculative decoding's acceptance counters, per request and per runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    """Counts over verification steps that had at least one draft."""

    num_drafts: int = 0  # verification steps with k ≥ 1
    num_draft_tokens: int = 0  # Σ k
    num_accepted_draft_tokens: int = 0  # Σ accepted drafts (not the recovered/bonus token)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: steps whose draft j was accepted

    def record(self, num_draft_tokens: int, num_accepted_drafts: int) -> None:
        """Count one verification step of one request."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_draft_tokens += num_accepted_drafts
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted_drafts):
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another request's counts into these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_draft_tokens += other.num_accepted_draft_tokens
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        self.accepted_per_position = [a + b for a, b in zip(mine, theirs)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verification step: 1 + accepted / drafts."""
        return 1 + self.num_accepted_draft_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for logs, manifests and notes."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": [
                c / self.num_drafts if self.num_drafts else 0.0 for c in self.accepted_per_position
            ],
        }
