"""Score a shard of rows: log-likelihood of a text, or of a completion given its prompt.

Modes: `text_column` scores every token after the first; `prompt_column` + `completion_column` scores only the
completion's tokens; `messages_column` scores the last assistant turn given the conversation before it.
Problem rows (empty text, too long without truncation, bad messages) get an `error`; the shard goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from workers.rows import chat_messages
from workers.runner import ModelRunner

SCORE_FIELDS = [
    pa.field("num_scored_tokens", pa.int32()),
    pa.field("sum_logprob", pa.float64()),
    pa.field("mean_logprob", pa.float64()),
    pa.field("perplexity", pa.float64()),
    pa.field("num_truncated_tokens", pa.int32()),
    pa.field("error", pa.string()),
]
TOKEN_LOGPROBS_FIELD = pa.field("token_logprobs", pa.list_(pa.float32()))


@dataclass(frozen=True)
class ScoreSpec:
    """Which columns to score and how (sent to the workers)."""

    text_column: str | None = None
    prompt_column: str | None = None
    completion_column: str | None = None
    messages_column: str | None = None
    add_bos: bool | None = None  # None: the tokenizer's default
    truncate: bool = False
    token_logprobs: bool = False

    @property
    def columns(self) -> list[str]:
        """The input columns a worker reads."""
        names = (self.text_column, self.prompt_column, self.completion_column, self.messages_column)
        return [c for c in names if c is not None]


def _text(row: dict[str, Any], column: str, allow_empty: bool = False) -> str:
    value = row[column]
    if not isinstance(value, str):
        raise ValueError(f"{column!r} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ValueError(f"{column!r} is empty")
    return value


def _encode(tokenizer: Any, text: str, special: bool | None) -> list[int]:
    return list(tokenizer.encode(text) if special is None else tokenizer.encode(text, add_special_tokens=special))


def tokens_to_score(row: dict[str, Any], spec: ScoreSpec, tokenizer: Any) -> tuple[list[int], int]:
    """(token ids, index of the first scored token) for one row; `ValueError` for a bad row."""
    if spec.text_column is not None:
        ids = _encode(tokenizer, _text(row, spec.text_column), spec.add_bos)
        if len(ids) < 2:
            raise ValueError(f"text has {len(ids)} token(s): nothing to score after the first")
        return ids, 1
    if spec.messages_column is not None:
        messages = chat_messages(row[spec.messages_column], spec.messages_column)
        if len(messages) < 2:
            raise ValueError(f"{spec.messages_column!r} needs a conversation ending in an assistant message")
        if messages[-1].get("role") != "assistant" or not messages[-1].get("content"):
            raise ValueError("the last message must be a non-empty assistant turn")
        kwargs = dict(tokenize=True, return_dict=False)
        try:
            prompt = list(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, **kwargs))
            full = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs))
        except Exception as error:
            raise ValueError(f"chat template failed: {error}") from error
        if full[: len(prompt)] != prompt or len(full) == len(prompt):
            raise ValueError("the chat template does not render the conversation as prompt + assistant turn")
        return full, len(prompt)
    prompt = _encode(tokenizer, _text(row, spec.prompt_column, allow_empty=True), spec.add_bos)
    completion = _encode(tokenizer, _text(row, spec.completion_column), False)
    if not prompt:
        raise ValueError("the prompt has no tokens: the first completion token has nothing to be scored from")
    return prompt + completion, len(prompt)


def score_shard(
    runner: ModelRunner,
    rows: list[dict[str, Any] | str],
    spec: ScoreSpec,
    on_forward: Callable[[], None] | None = None,
) -> dict[str, list[Any]]:
    """Score every row (a row given as a string is one that could not be decoded: that is its error); columns in
    SCORE_FIELDS order (plus `token_logprobs` when asked). `on_forward`: see `ModelRunner.score`."""
    limit = runner.max_model_len
    sequences, firsts, positions = [], [], []
    errors: list[str | None] = [None] * len(rows)
    truncated = [0] * len(rows)
    for i, row in enumerate(rows):
        try:
            if isinstance(row, str):
                raise ValueError(row)
            ids, first = tokens_to_score(row, spec, runner.tokenizer)
            if len(ids) > limit:
                if not spec.truncate:
                    raise ValueError(f"row has {len(ids)} tokens, more than max_model_len={limit} (use --truncate)")
                if first >= limit:
                    raise ValueError(f"the prompt alone fills max_model_len={limit}: no completion token left")
                truncated[i], ids = len(ids) - limit, ids[:limit]
        except (ValueError, TypeError) as error:
            errors[i] = str(error)
            continue
        sequences.append(ids)
        firsts.append(first)
        positions.append(i)
    scored: list[list[float] | None] = [None] * len(rows)
    for i, first, result in zip(positions, firsts, runner.score(sequences, on_forward) if sequences else []):
        if result.error:
            errors[i] = result.error
        else:
            scored[i] = result.token_logprobs[first - 1 :]  # logprob of token t+1 sits at index t
    return _columns(scored, truncated, errors, spec.token_logprobs)


def _columns(scored: list[list[float] | None], truncated: list[int], errors: list[str | None], with_tokens: bool):
    columns: dict[str, list[Any]] = {f.name: [] for f in SCORE_FIELDS}
    if with_tokens:
        columns[TOKEN_LOGPROBS_FIELD.name] = []
    for logprobs, cut, error in zip(scored, truncated, errors):
        total = math.fsum(logprobs) if logprobs is not None else None
        mean = total / len(logprobs) if logprobs else None
        values = [len(logprobs) if logprobs is not None else 0, total, mean,
                  math.exp(-mean) if mean is not None else None, cut, error]  # fmt: skip
        for f, value in zip(SCORE_FIELDS, values):
            columns[f.name].append(value)
        if with_tokens:
            columns[TOKEN_LOGPROBS_FIELD.name].append(logprobs)
    return columns
