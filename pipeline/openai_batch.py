"""OpenAI batch input lines → the rows of a generation job (vLLM's `run_batch` input format).

A line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}`. A
chat body's `messages` render with the model's chat template, a completion body's `prompt` is the text itself.
The body's sampling fields become the row's per-row parameters (`workers/row_params.py`): `max_tokens` /
`max_completion_tokens`, `logprobs` / `top_logprobs`, `response_format` (a JSON schema or `json_object`) as
`structured_outputs`, and every other field by its `SamplingParams` name (`temperature`, `top_p`, `seed`, `stop`,
vLLM's extras such as `top_k` or `ignore_eos`, the penalties, …). A field that is not a sampling parameter and not
one of OpenAI's bookkeeping fields (`IGNORED_FIELDS`) is handed on too, so the row fails naming it, as vLLM does.

A line that cannot run (not JSON, no custom_id, another url, no body, no prompt) is a `LineError` here, on the
driver; a bad parameter value is found on the worker and is the row's `error`. Both become error lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
# OpenAI request fields that do not change what is generated (and `model`: the job serves one model).
IGNORED_FIELDS = frozenset(
    {"model", "user", "stream", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls"}
)


class LineError(ValueError):
    """A batch input line that cannot run; its message becomes the line's error."""


@dataclass(frozen=True)
class BatchRequest:
    """One runnable line: its place in the file, the prompt (text or chat messages as JSON) and parameters."""

    line: int  # 0-based line number among the file's non-blank lines
    custom_id: str
    url: str
    prompt: str | None  # a completion's prompt text
    messages: str | None  # a chat's messages, JSON text
    sampling_params: str  # JSON object of SamplingParams fields (the row's `--sampling-params-column` value)
    n: int  # choices the line asked for (the job runs max n per row and keeps the first n)


def parse_line(text: str, line: int, default_n: int = 1) -> tuple[str | None, BatchRequest | LineError]:
    """(the line's custom_id if it has one, its request or why it cannot run)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return None, LineError(f"line {line + 1} is not JSON ({error})")
    if not isinstance(value, dict):
        return None, LineError(f"line {line + 1} is not a JSON object")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, LineError(f"line {line + 1}: custom_id must be a non-empty string")
    try:
        return custom_id, _request(value, custom_id, line, default_n)
    except LineError as error:
        return custom_id, error


def _request(value: dict[str, Any], custom_id: str, line: int, default_n: int) -> BatchRequest:
    method, url, body = value.get("method", "POST"), value.get("url"), value.get("body")
    if method != "POST":
        raise LineError(f"method {method!r} is not supported: only POST")
    if url not in URLS:
        raise LineError(f"url {url!r} is not supported: use {' or '.join(URLS)}")
    if not isinstance(body, dict):
        raise LineError("body must be a JSON object")
    chat = url == CHAT_URL
    prompt, messages = None, None
    if chat:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise LineError("body.messages must be a non-empty list of messages")
        messages = json.dumps(body["messages"])
    else:
        if not isinstance(body.get("prompt"), str):
            raise LineError("body.prompt must be a string (one prompt per line)")
        prompt = body["prompt"]
    n = body.get("n", default_n)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise LineError(f"body.n={n!r} is invalid: must be an integer ≥ 1")
    params = body_sampling_params(body, chat)
    return BatchRequest(line, custom_id, url, prompt, messages, json.dumps(params), n)


def body_sampling_params(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A request body's sampling fields as `SamplingParams` fields (see the module docstring)."""
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in IGNORED_FIELDS or key in ("messages", "prompt", "n", "top_logprobs"):
            continue
        if key in ("max_tokens", "max_completion_tokens"):
            if value is not None:
                params["max_tokens"] = value
        elif key == "logprobs":
            params.update(_logprobs(body, chat))
        elif key == "response_format":
            params.update(_response_format(value))
        elif key == "echo":
            if value:
                raise LineError("body.echo is not supported")
        else:
            params[key] = value
    if "top_logprobs" in body and "logprobs" not in body:
        raise LineError("body.top_logprobs needs body.logprobs = true")
    return params


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Chat: `logprobs` true (+ `top_logprobs` k) → k; completions: `logprobs` k → k."""
    value = body["logprobs"]
    if not chat:
        return {"logprobs": value}  # null: none, whatever --logprobs says
    if not isinstance(value, bool):
        raise LineError(f"body.logprobs={value!r} is invalid: must be true or false")
    top = body.get("top_logprobs")
    if not value:
        if top:
            raise LineError("body.top_logprobs needs body.logprobs = true")
        return {"logprobs": None}
    return {"logprobs": 0 if top is None else top}


def _response_format(value: Any) -> dict[str, Any]:
    """`{"type": "json_schema", "json_schema": {"schema": …}}` / `{"type": "json_object"}` / `{"type": "text"}`."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"structured_outputs": {"json": {"type": "object"}}}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise LineError("body.response_format.json_schema.schema must be a JSON schema object")
        return {"structured_outputs": {"json": schema}}
    raise LineError(f"body.response_format.type={kind!r} is invalid: must be text, json_object or json_schema")


def parse_lines(text: str, default_n: int = 1) -> list[tuple[str | None, BatchRequest | LineError]]:
    """Every non-blank line of a batch input file, in order; a custom_id used by an earlier line makes the later
    line an error (the output must name each custom_id once)."""
    seen: set[str] = set()
    parsed = []
    for line, raw in enumerate(raw for raw in text.splitlines() if raw.strip()):
        custom_id, request = parse_line(raw, line, default_n)
        if custom_id is not None and custom_id in seen:
            request = LineError(f"custom_id {custom_id!r} is used by an earlier line")
        if custom_id is not None:
            seen.add(custom_id)
        parsed.append((custom_id, request))
    return parsed
