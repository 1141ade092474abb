"""Speculative decoding configuration."""

from __future__ import annotations

from dataclasses import dataclass

from workers.spec_decode import registry
from workers.spec_decode.policy import POLICIES
from workers.spec_decode.proposal import Proposer


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the runner proposes draft tokens for the target to verify.

    method "ngram": prompt lookup over the request's prompt + generated tokens (n-grams of
    `prompt_lookup_min`…`prompt_lookup_max` tokens). method "draft": a smaller model (`draft_model`, a local
    directory or hub id with the target's vocabulary), attention-only or hybrid. method "mtp": the target
    checkpoint's own multi-token-prediction head (Qwen3-Next / Qwen3.5 or Nemotron-H `mtp.*` weights), chained k
    times. `policy` "adaptive" picks each step's number of drafts (0 … num_speculative_tokens) from measured step times
    and acceptance; "fixed" always asks for num_speculative_tokens (see `workers/spec_decode/policy.py`).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    policy: str = "adaptive"
    draft_revision: str | None = None  # a hub draft model's branch, tag or commit (the driver pins a commit)

    @property
    def proposer_class(self) -> type[Proposer]:
        """The method's proposer class, whose declarations say what the method needs and offers."""
        return registry.method(self.method).proposer_class

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"SpeculativeConfig.policy={self.policy!r} is invalid: must be one of {', '.join(POLICIES)}"
            )
        if self.method not in registry.method_names():
            methods = ", ".join(registry.method_names())
            raise ValueError(f"SpeculativeConfig.method={self.method!r} is invalid: must be one of {methods}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens={self.num_speculative_tokens!r} is invalid: "
                "must be an integer in [1, 16]"
            )
        if self.proposer_class.needs_draft_model and not self.draft_model:
            raise ValueError(
                f"SpeculativeConfig.draft_model is required when method={self.method!r} (a model dir or hub id)"
            )
        if not self.proposer_class.needs_draft_model and self.draft_model:
            raise ValueError("SpeculativeConfig.draft_model is only used with method='draft'")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise ValueError(f"SpeculativeConfig.prompt_lookup_min={self.prompt_lookup_min!r} is invalid: must be ≥ 1")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_max={self.prompt_lookup_max!r} is invalid: "
                f"must be ≥ prompt_lookup_min ({self.prompt_lookup_min})"
            )
