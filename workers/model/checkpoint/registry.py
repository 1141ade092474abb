"""The checkpoint families hybridgen reads, by model type: what each family adds to the core.

A family (`families/`) is one module with a config reader and a weight map; it registers itself here when
`workers.model.checkpoint.families` imports it. The core (`config.py`, `weights.py`, `loader.py`) looks families up
here and never imports a family module, so a family builds on the core's dataclasses without an import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One checkpoint family: the `model_type`s of its `config.json` and how to read its config and weights."""

    model_types: tuple[str, ...]
    # The parsed config.json → every `HybridConfig` field but model_type.
    read_config: Callable[[dict[str, Any]], dict[str, Any]]
    # (the `HybridConfig`, the checkpoint's keys) → every parameter name but lm_head → its candidate `Source`s.
    # The registry sits below config.py and weights.py, which look families up here, so it names their types in
    # words, not imports (an import, even for type checking only, would close a circle).
    weight_sources: Callable[[Any, set[str]], dict[str, list[Any]]]
    # The `HybridConfig` → the checkpoint keys that frame the family's MTP head; None: its MTP heads are not served.
    mtp_head_keys: Callable[[Any], list[str]] | None = None


_FAMILIES: dict[str, Family] = {}  # model_type → its family, in the order families registered


def register(family: Family) -> Family:
    """Add `family` under each of its model types (each may be registered once)."""
    taken = [model_type for model_type in family.model_types if model_type in _FAMILIES]
    assert not taken, f"model types registered twice: {taken}"
    _FAMILIES.update(dict.fromkeys(family.model_types, family))
    return family


def family_of(model_type: str) -> Family | None:
    """The family that reads `model_type`, or None when no family does."""
    return _FAMILIES.get(model_type)


def model_types() -> tuple[str, ...]:
    """Every registered model type, in registration order."""
    return tuple(_FAMILIES)


def mtp_model_types() -> tuple[str, ...]:
    """The model types whose multi-token-prediction heads are served, in registration order."""
    return tuple(model_type for model_type, family in _FAMILIES.items() if family.mtp_head_keys is not None)
