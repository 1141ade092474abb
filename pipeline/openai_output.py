"""A generation job's output rows → OpenAI batch output lines (vLLM's `run_batch` output format).

A line that ran: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <a chat.completion or
text_completion object>}, "error": null}`. A line that could not run (a bad line, or a row whose parameters or
prompt failed): `{"id", "custom_id", "response": {"status_code": 400, "request_id", "body": null}, "error": {"code",
"message"}}` — vLLM's status and OpenAI's error object. Ids are derived from the line and its custom_id, and
`created` is the job's first start, so a resumed job writes the same file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from pipeline.openai_batch import CHAT_URL

BAD_REQUEST = 400


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:32]


def error_line(custom_id: str | None, line: int, message: str) -> dict[str, Any]:
    """The output line of a request that did not run."""
    return {
        "id": f"vllm-{_digest('line', line, custom_id)}",
        "custom_id": custom_id,
        "response": {"status_code": BAD_REQUEST, "request_id": f"vllm-batch-{_digest('request', line)}", "body": None},
        "error": {"code": "invalid_request", "message": message},
    }


def response_line(
    row: dict[str, Any], samples: list[dict[str, Any]], model: str, created: int, decode: Callable[[int], str]
) -> dict[str, Any]:
    """The output line of a request that ran: `row` is its input row (custom_id, url, line, n), `samples` its
    output rows in sample order (the first n are its choices); `decode` spells one token id."""
    line, custom_id, chat = row["line"], row["custom_id"], row["url"] == CHAT_URL
    if samples[0]["error"] is not None:
        return error_line(custom_id, line, samples[0]["error"])
    choices = [_choice(j, sample, chat, decode) for j, sample in enumerate(samples[: row["n"]])]
    prompt_tokens = samples[0]["num_prompt_tokens"]
    completion_tokens = sum(s["num_generated_tokens"] for s in samples[: row["n"]])
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{_digest('body', line, custom_id)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    return {
        "id": f"vllm-{_digest('line', line, custom_id)}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"vllm-batch-{_digest('request', line)}", "body": body},
        "error": None,
    }


def _choice(index: int, sample: dict[str, Any], chat: bool, decode: Callable[[int], str]) -> dict[str, Any]:
    text = sample["generated_text"] or ""
    if chat:
        message = {"role": "assistant", "content": text}
        if "reasoning_text" in sample:  # --reasoning-parser: the thinking part apart, as vLLM's reasoning_content
            message["reasoning_content"] = sample["reasoning_text"]
        return {
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(sample, decode),
            "finish_reason": sample["finish_reason"],
        }
    return {
        "index": index,
        "text": text,
        "logprobs": _completion_logprobs(sample, decode),
        "finish_reason": sample["finish_reason"],
    }


def _chat_logprobs(sample: dict[str, Any], decode: Callable[[int], str]) -> dict[str, Any] | None:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    if sample.get("logprobs") is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = decode(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for token_id, logprob, top in zip(sample["generated_token_ids"], sample["logprobs"], sample["top_logprobs"]):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(t["token_id"], t["logprob"]) for t in top]
        content.append(item)
    return {"content": content}


def _completion_logprobs(sample: dict[str, Any], decode: Callable[[int], str]) -> dict[str, Any] | None:
    """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs ({token: logprob} per position),
    text_offset."""
    if sample.get("logprobs") is None:
        return None
    tokens = [decode(t) for t in sample["generated_token_ids"]]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [{decode(t["token_id"]): t["logprob"] for t in position} for position in sample["top_logprobs"]]
    return {"tokens": tokens, "token_logprobs": sample["logprobs"], "top_logprobs": top, "text_offset": offsets}
