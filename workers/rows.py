"""Turn a shard of input rows into output rows: prompts → token ids → generation → Arrow columns.

Row problems (a cell that cannot be decoded, not a string, empty, over-long, bad chat messages) become that row's
`error`; the shard goes on. Rows are tokenized one at a time as the engine takes them (`shard_requests` is lazy), so
a worker never holds a whole shard's token ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from workers.chat import ChatOptions
from workers.requests import GenerationResult
from workers.row_params import row_sampling
from workers.runner import ModelRunner
from workers.sampling import SamplingParams

GENERATE_FIELDS = [
    pa.field("sample_index", pa.int32()),  # which of the row's `--n` samples (the output has one row per sample)
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
# With `SamplingParams.logprobs` = k: per generated token its logprob, and the top k at its position in rank order.
TOP_LOGPROB = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])
LOGPROBS_FIELDS = [
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
]
# With a reasoning parser (`workers/reasoning.py`): the reasoning part; generated_text then holds the answer part.
REASONING_FIELDS = [pa.field("reasoning_text", pa.string())]


def chat_messages(value: Any, column: str) -> list[dict[str, Any]]:
    """A row's chat messages as transformers' `apply_chat_template` takes them (a JSON text cell parsed); messages
    may carry any other keys (`name`, `tool_calls`, `tool_call_id`) and null content. `ValueError` for a bad row."""
    if isinstance(value, str):  # a text column holding JSON (a CSV, a JSONL string)
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{column!r} is text that is not a JSON list of messages") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"{column!r} must be a non-empty list of {{role, content}} messages")
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"each message needs a 'role', got {message!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"a message's 'content' must be text, a list of parts or null, got {content!r}")
    return value


@dataclass(frozen=True)
class PromptSource:
    """Which input column holds the prompt, in which form, and how chat rows are rendered (`workers/chat.py`)."""

    prompt_column: str | None = None
    messages_column: str | None = None
    chat: ChatOptions = field(default_factory=ChatOptions)
    # A struct or JSON-text column whose fields override the job's SamplingParams per row (`workers/row_params.py`).
    sampling_params_column: str | None = None

    @property
    def columns(self) -> list[str]:
        """The input columns a worker reads."""
        return [c for c in (self.prompt_column, self.messages_column, self.sampling_params_column) if c is not None]

    def token_ids(self, row: dict[str, Any], tokenizer: Any) -> list[int]:
        """The row's prompt as token ids; `ValueError` with a readable message for a bad row. With both columns
        (an OpenAI batch file's mix of completions and chats), a row whose prompt is null is a chat."""
        if self.prompt_column is not None and (self.messages_column is None or row[self.prompt_column] is not None):
            text = row[self.prompt_column]
            if not isinstance(text, str):
                raise ValueError(f"{self.prompt_column!r} must be a string, got {type(text).__name__}")
            if not text.strip():
                raise ValueError("prompt text is empty")
            return list(tokenizer.encode(text))
        return self.chat.render(tokenizer, chat_messages(row[self.messages_column], self.messages_column))


def error_result(error: str, sample_index: int = 0) -> GenerationResult:
    """The result of a row (one of its samples) that never ran."""
    return GenerationResult([], "error", error, None, 0, sample_index=sample_index)


def generation_fields(num_logprobs: int | None, chat: ChatOptions, per_row_params: bool = False) -> list[pa.Field]:
    """The output schema's task fields: GENERATE_FIELDS, then LOGPROBS_FIELDS and REASONING_FIELDS when asked
    (LOGPROBS_FIELDS always with `per_row_params`: rows may ask for logprobs themselves)."""
    logprobs = LOGPROBS_FIELDS if num_logprobs is not None or per_row_params else []
    return GENERATE_FIELDS + logprobs + (REASONING_FIELDS if chat.reasoning_parser is not None else [])


def generation_columns(
    results: list[GenerationResult],
    num_logprobs: int | list[int | None] | None = None,
    chat: ChatOptions | None = None,
) -> dict[str, list[Any]]:
    """Output columns (`generation_fields` order), one row per result; `num_logprobs`: the job's k, or one k per
    result when rows set their own. With `chat`'s reasoning parser, generated_text is each text's answer part and
    reasoning_text its reasoning part."""
    columns: dict[str, list[Any]] = {f.name: [] for f in GENERATE_FIELDS}
    if num_logprobs is not None:
        columns.update(logprobs_columns(results, num_logprobs))
    if chat is not None and chat.reasoning_parser is not None:
        splits = [chat.split(result.text) for result in results]
        columns["reasoning_text"] = [reasoning for reasoning, _ in splits]
        results = [dataclasses.replace(r, text=answer) for r, (_, answer) in zip(results, splits)]
    for result in results:
        values = [
            result.sample_index,
            result.text,
            result.token_ids,
            result.num_prompt_tokens,
            len(result.token_ids),
            result.finish_reason,
            result.error,
            result.num_drafts,
            result.num_draft_tokens,
            result.num_accepted_draft_tokens,
        ]
        for f, value in zip(GENERATE_FIELDS, values):
            columns[f.name].append(value)
    return columns


def logprobs_columns(results: list[GenerationResult], num_logprobs: int | list[int | None]) -> dict[str, list[Any]]:
    """The LOGPROBS_FIELDS columns: each token's logprob, and the first k entries of its position (the top k, in rank
    order: `GenerationResult.logprobs`; k = `num_logprobs`, or its entry for the result when a list); null for a row
    without logprobs (an error, or a row that asked for none)."""
    columns: dict[str, list[Any]] = {f.name: [] for f in LOGPROBS_FIELDS}
    ks = num_logprobs if isinstance(num_logprobs, list) else [num_logprobs] * len(results)
    for result, k in zip(results, ks):
        entries = result.logprobs
        if entries is None or k is None:
            columns["logprobs"].append(None)
            columns["top_logprobs"].append(None)
            continue
        columns["logprobs"].append([entry[token] for token, entry in zip(result.token_ids, entries)])
        columns["top_logprobs"].append(
            [[{"token_id": t, "logprob": lp} for t, lp in list(entry.items())[:k]] for entry in entries]
        )
    return columns


def shard_requests(
    tokenizer: Any,
    rows: Iterable[dict[str, Any] | str],
    source: PromptSource,
    sampling: SamplingParams,
    first_row: int,
    row_logprobs: list[int | None] | None = None,
) -> Iterator[tuple[list[int] | str, SamplingParams | None]]:
    """Per row, lazily: (prompt token ids, its sampling) or (why it cannot run, None). A row given as a string is
    one that could not be decoded. Row i of the dataset samples with seed + i when a seed is set, unless its
    `sampling_params_column` value sets a seed; that value's other fields override the job's too. `row_logprobs`:
    each row's `logprobs` is appended to it as the row is read (None for a row that cannot run)."""
    seed, column = sampling.seed, source.sampling_params_column
    for i, row in enumerate(rows):
        row_seed = None if seed is None else seed + first_row + i
        try:
            if isinstance(row, str):
                raise ValueError(row)
            ids = source.token_ids(row, tokenizer)
            if column is None:
                params = dataclasses.replace(sampling, seed=row_seed)
            else:
                params = row_sampling(sampling, row[column], column, row_seed)
        except (ValueError, TypeError) as error:
            if row_logprobs is not None:
                row_logprobs.append(None)
            yield str(error), None
            continue
        if row_logprobs is not None:
            row_logprobs.append(params.logprobs)
        yield ids, params


def generate_shard(
    runner: ModelRunner, rows: list[dict[str, Any]], source: PromptSource, sampling: SamplingParams, first_row: int
) -> dict[str, list[Any]]:
    """Generate for every row of a shard in one `generate` call (the streaming worker feeds `shard_requests` to
    its stream instead): `sampling.n` output rows per input row, row-major."""
    per_row: list[int | None] | None = None if source.sampling_params_column is None else []
    requests = list(shard_requests(runner.tokenizer, rows, source, sampling, first_row, per_row))
    runnable = [(prompt, params) for prompt, params in requests if params is not None]
    generated = iter(runner.generate([p for p, _ in runnable], [s for _, s in runnable]) if runnable else [])
    results = []
    for prompt, params in requests:
        for j in range(sampling.n):
            results.append(next(generated) if params is not None else error_result(prompt, j))
    return generation_columns(results, per_result_logprobs(sampling, per_row), source.chat)


def per_result_logprobs(
    sampling: SamplingParams, row_logprobs: list[int | None] | None
) -> int | list[int | None] | None:
    """`generation_columns`' `num_logprobs`: the job's k, or (rows with their own parameters) each row's k repeated
    for its `sampling.n` results."""
    if row_logprobs is None:
        return sampling.logprobs
    return [k for k in row_logprobs for _ in range(sampling.n)]
