"""The job's logits-option flags as `SamplingParams` takes them: `--allowed-token-ids` repeated or as a JSON list,
`--logit-bias` as a JSON object of token id → bias (one spelling of each in the manifest and resume fingerprint)."""

from __future__ import annotations

import json
from typing import Any

from pipeline.fields import fail


def token_ids_flag(values: Any) -> tuple[int, ...] | None:
    """`--allowed-token-ids`: None (not given), or the ids of every value — each an integer, or a JSON list of
    integers (`--allowed-token-ids 5 --allowed-token-ids 7`, `--allowed-token-ids '[5, 7]'`, a YAML list)."""
    if values is None:
        return None
    ids: list[int] = []
    for value in [values] if isinstance(values, (str, int)) else values:
        parsed = json.loads(value) if isinstance(value, str) and value.strip().startswith("[") else value
        for item in parsed if isinstance(parsed, list) else [parsed]:
            try:
                ids.append(int(item))
            except (TypeError, ValueError):
                fail("SamplingConfig", "allowed_token_ids", values, "must be token ids (integers ≥ 0)")
    if not ids or min(ids) < 0:
        fail("SamplingConfig", "allowed_token_ids", values, "must be a non-empty list of token ids ≥ 0")
    return tuple(ids)


def logit_bias_flag(value: Any) -> dict[str, float] | None:
    """`--logit-bias`: None, or {token id (a string, as JSON keys are): bias} from a JSON object or a mapping."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        fail("SamplingConfig", "logit_bias", value, 'must be a JSON object {"token id": bias}')
    try:
        return {str(int(token)): float(bias) for token, bias in value.items()}
    except (TypeError, ValueError):
        fail("SamplingConfig", "logit_bias", value, 'must map token ids to numbers, e.g. {"50256": -100}')
