"""Per-row sampling parameters: a row's `--sampling-params-column` value overrides the job's `SamplingParams`.

The value is a struct (a dict) or JSON text holding an object; its keys are `SamplingParams` field names (vLLM's),
read from `dataclasses.fields(SamplingParams)`, so a field added there is overridable here with no edit. Values are
brought to the field's type where JSON cannot spell it (a list for a tuple, "12" keys for an int-keyed dict, a dict
for `structured_outputs`), then `SamplingParams` validates them as it does every other value. vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` spell `structured_outputs`. A bad value raises
`ValueError` naming the field; the caller makes it that row's `error`. A constraint that does not compile is that
row's error too, from the engine's compile (`workers/engine.py`, one compile per distinct constraint).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from functools import cache
from typing import Any

from workers.sampling import SamplingParams
from workers.structured_outputs import KINDS, StructuredOutputsParams

GUIDED_ALIASES = {f"guided_{kind}": kind for kind in KINDS}  # vLLM's pre-0.10 names → StructuredOutputsParams kind


@cache
def _field_types() -> dict[str, Any]:
    """`SamplingParams` field name → its annotation (resolved; as written when a name in it cannot be resolved at
    run time, and its values are then left to `SamplingParams` to judge as they come)."""
    try:
        hints = typing.get_type_hints(SamplingParams)
    except NameError:
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(SamplingParams) if f.init}


def row_overrides(value: Any, column: str) -> dict[str, Any]:
    """A row's overrides as a dict (null or empty: none); `ValueError` naming the column for a value that is not an
    object or JSON text of one."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{column!r} is text that is not a JSON object ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{column!r} must be an object of SamplingParams fields, got {type(value).__name__}")
    return value


def override_sampling(base: SamplingParams, overrides: dict[str, Any], column: str) -> SamplingParams:
    """`base` with `overrides` applied; `ValueError` naming the field (and `column`) for an unknown field, a value
    of the wrong type or an invalid one."""
    types_ = _field_types()
    values: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in GUIDED_ALIASES:
            if value is None:
                continue
            key, value = "structured_outputs", {GUIDED_ALIASES[key]: value}
        if key not in types_:
            raise ValueError(
                f"{column}.{key}: not a SamplingParams field (allowed: {', '.join(sorted(types_))}, "
                f"{', '.join(sorted(GUIDED_ALIASES))})"
            )
        if key in values:
            raise ValueError(f"{column}.{key}: given twice (a guided_* alias and structured_outputs)")
        try:
            values[key] = _coerce(value, types_[key])
        except (TypeError, ValueError) as error:
            raise ValueError(f"{column}.{key}: {error}") from None
    try:
        return dataclasses.replace(base, **values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{column}: {error}") from None


def _coerce(value: Any, annotation: Any) -> Any:
    """A JSON value as the field's type expects it; anything else is left for `SamplingParams` to judge."""
    if value is None:
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return _coerce(value, kinds[0]) if len(kinds) == 1 else value
    if annotation is StructuredOutputsParams:
        return _constraint(value)
    if origin is tuple and isinstance(value, list):
        return tuple(_coerce(item, args[0]) if args else item for item in value)
    if origin is dict and isinstance(value, dict) and args and args[0] is int:
        return {_int_key(key): item for key, item in value.items()}
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _int_key(key: Any) -> Any:
    """A JSON object key meant as an integer ("50256" → 50256); other keys stay for validation to reject."""
    if isinstance(key, str) and key.lstrip("-").isdigit():
        return int(key)
    return key


def _constraint(value: Any) -> StructuredOutputsParams:
    """{"json": …} / {"regex": …} / {"choice": […]} / {"grammar": …} → `StructuredOutputsParams`."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"must be an object with one of {', '.join(KINDS)}, got {value!r}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown keys {unknown}: give one of {', '.join(KINDS)}")
    return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})


def row_sampling(base: SamplingParams, value: Any, column: str, seed_for_row: int | None) -> SamplingParams:
    """A row's `SamplingParams`: the job's, its seed replaced by the row's (`seed_for_row`, the job's seed + row
    index) unless the row sets its own, then the row's overrides. A row may not change `n` (the output has the
    job's n rows per input row): `ValueError` naming `n` unless it equals the job's."""
    overrides = row_overrides(value, column)
    if "n" in overrides and overrides["n"] != base.n:
        raise ValueError(f"{column}.n={overrides['n']!r}: a row's n must equal the job's --n ({base.n})")
    params = dataclasses.replace(base, seed=seed_for_row)
    return override_sampling(params, overrides, column) if overrides else params
