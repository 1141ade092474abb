"""The speculative methods, by name: each method's proposer class and how a runner builds it.

A new method is one module (a `Proposer` subclass declaring what it offers and needs) plus one `register` call
here, or in the caller's own code. Nothing else compares method names: the runner and the scheduler read the
proposer class's declarations (`drafts_from_hidden`, `drafts_cost_nothing`, `needs_draft_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workers.model import HybridModel
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.mtp import MtpProposer
from workers.spec_decode.ngram import NgramProposer
from workers.spec_decode.proposal import Proposer


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built from: the speculative config's values, the target model, the draft model (for a
    proposer that `needs_draft_model`) and whether its steps may run as decode plans."""

    target: HybridModel
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    draft_model: HybridModel | None = None
    decode_plan: bool = True


@dataclass(frozen=True)
class Method:
    """One speculative method: its proposer class (read for its declarations before it is built) and builder."""

    name: str
    proposer_class: type[Proposer]
    build: Callable[[ProposerContext], Proposer]


_METHODS: dict[str, Method] = {}


def register(name: str, proposer_class: type[Proposer], build: Callable[[ProposerContext], Proposer]) -> None:
    """Make `name` a speculative method (`SpeculativeConfig(method=name)`) proposing with `build(context)`."""
    if name in _METHODS or name == "none":
        raise ValueError(f"speculative method {name!r} is already taken")
    _METHODS[name] = Method(name, proposer_class, build)


def unregister(name: str) -> None:
    """Remove a method `register` added (tests that add one of their own)."""
    del _METHODS[name]


def method(name: str) -> Method:
    """The registered method `name`; `ValueError` naming the methods there are otherwise."""
    if name not in _METHODS:
        raise ValueError(f"speculative method {name!r} is unknown: must be one of {', '.join(_METHODS)}")
    return _METHODS[name]


def method_names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_METHODS)


register("ngram", NgramProposer, lambda c: NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max))
register(
    "draft", DraftModelProposer, lambda c: DraftModelProposer(c.draft_model, c.num_speculative_tokens, c.decode_plan)
)
register("mtp", MtpProposer, lambda c: MtpProposer(c.target, c.num_speculative_tokens, c.decode_plan))
