"""Turn a shard of input rows into output rows: prompts → token ids → generation → Arrow columns.

Row problems (not a string, empty, over-long, bad chat messages) become that row's `error`; the shard goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from workers.requests import GenerationResult
from workers.runner import ModelRunner
from workers.sampling import SamplingParams

GENERATE_FIELDS = [
    pa.field("generated_text", pa.string()),
    pa.field("generated_token_ids", pa.list_(pa.int32())),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("num_drafts", pa.int32()),
    pa.field("num_draft_tokens", pa.int32()),
    pa.field("num_accepted_draft_tokens", pa.int32()),
]


@dataclass(frozen=True)
class PromptSource:
    """Which input column holds the prompt, and in which form."""

    prompt_column: str | None = None
    messages_column: str | None = None

    def token_ids(self, row: dict[str, Any], tokenizer: Any) -> list[int]:
        """The row's prompt as token ids; `ValueError` with a readable message for a bad row."""
        if self.prompt_column is not None:
            text = row[self.prompt_column]
            if not isinstance(text, str):
                raise ValueError(f"{self.prompt_column!r} must be a string, got {type(text).__name__}")
            if not text.strip():
                raise ValueError("prompt text is empty")
            return list(tokenizer.encode(text))
        messages = row[self.messages_column]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{self.messages_column!r} must be a non-empty list of {{role, content}} messages")
        for message in messages:
            if not isinstance(message, dict) or not {"role", "content"} <= set(message):
                raise ValueError(f"each message needs 'role' and 'content', got {message!r}")
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as error:  # the template itself rejected the messages
            raise ValueError(f"chat template failed: {error}") from error
        return list(ids)


def generation_columns(results: list[GenerationResult | None], errors: list[str | None]) -> dict[str, list[Any]]:
    """Output columns (GENERATE_FIELDS order) for results, with `errors[i]` for rows that never ran."""
    columns: dict[str, list[Any]] = {f.name: [] for f in GENERATE_FIELDS}
    for result, error in zip(results, errors):
        if result is None:
            values = [None, [], 0, 0, "error", error, 0, 0, 0]
        else:
            values = [
                result.text, result.token_ids, result.num_prompt_tokens, len(result.token_ids),
                result.finish_reason, result.error, result.num_drafts, result.num_draft_tokens,
                result.num_accepted_draft_tokens,
            ]  # fmt: skip
        for f, value in zip(GENERATE_FIELDS, values):
            columns[f.name].append(value)
    return columns


@dataclass
class ShardPrompts:
    """A shard's rows as prompts: the rows that tokenized, their prompts and sampling, and the others' errors."""

    positions: list[int]  # row positions within the shard that run
    prompts: list[list[int]]
    params: list[SamplingParams]
    errors: list[str | None]  # per row of the shard: why it does not run, or None

    def columns(self, results: list[GenerationResult]) -> dict[str, list[Any]]:
        """Output columns for the whole shard, given the results of `prompts` in order."""
        by_row: list[GenerationResult | None] = [None] * len(self.errors)
        for position, result in zip(self.positions, results):
            by_row[position] = result
        return generation_columns(by_row, self.errors)


def shard_prompts(
    tokenizer: Any, rows: list[dict[str, Any]], source: PromptSource, sampling: dict[str, Any], first_row: int
) -> ShardPrompts:
    """Tokenize a shard's rows; row i of the dataset samples with seed + i when a seed is set."""
    prompts = ShardPrompts([], [], [], [None] * len(rows))
    seed = sampling.get("seed")
    for i, row in enumerate(rows):
        try:
            prompts.prompts.append(source.token_ids(row, tokenizer))
        except (ValueError, TypeError) as error:
            prompts.errors[i] = str(error)
            continue
        prompts.params.append(SamplingParams(**{**sampling, "seed": None if seed is None else seed + first_row + i}))
        prompts.positions.append(i)
    return prompts


def generate_shard(
    runner: ModelRunner, rows: list[dict[str, Any]], source: PromptSource, sampling: dict[str, Any], first_row: int
) -> dict[str, list[Any]]:
    """Generate for every row of a shard in one `generate` call (the streaming worker uses `shard_prompts`)."""
    prompts = shard_prompts(runner.tokenizer, rows, source, sampling, first_row)
    return prompts.columns(runner.generate(prompts.prompts, prompts.params) if prompts.prompts else [])
