"""Reasoning parsers (vLLM's `--reasoning-parser` names): a generated text → (reasoning, answer).

Pure string functions, one per family spelling, following vLLM's non-streaming `extract_reasoning`:
- `deepseek_r1`: `<think>…</think>`; the opening tag may be in the prompt, so the text before `</think>` is
  reasoning; with no `</think>` (cut by max_tokens mid-thought) the whole text is reasoning, the answer None.
- `qwen3`: the same, except that with thinking switched off (`chat_template_kwargs` `enable_thinking: false`) a text
  without `</think>` is all answer.
- `nemotron` (vLLM's `nemotron_v3`, Nemotron-H / Nemotron 3): `deepseek_r1`'s split; with thinking switched off
  an unclosed text is the answer.
- `granite`: "Here is my thought process: … Here is my response: …" (also "Here's"); a text with the thought
  marker and no response marker is all reasoning (as vLLM's streaming parser reports it), one without the thought
  marker all answer.
Either part is None when empty, as vLLM returns it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
GRANITE_THOUGHT = re.compile(r"(?:Here's|Here is) my thought process:")
GRANITE_RESPONSE = re.compile(r"(?:Here's|Here is) my response:")

Split = tuple[str | None, str | None]  # (reasoning, answer)


def _or_none(text: str) -> str | None:
    return text or None


def split_think(text: str, thinking: bool = True) -> Split:
    """`<think>reasoning</think>answer`, the opening tag optional; unclosed: all reasoning, or all answer when
    `thinking` is off."""
    head, start, rest = text.partition(THINK_START)
    text = rest if start else head
    reasoning, end, answer = text.partition(THINK_END)
    if end:
        return reasoning, _or_none(answer)
    return (text, None) if thinking else (None, text)


def split_deepseek_r1(text: str, chat_template_kwargs: dict[str, Any]) -> Split:
    """vLLM's `deepseek_r1`: `split_think`, thinking always on."""
    return split_think(text)


def split_qwen3(text: str, chat_template_kwargs: dict[str, Any]) -> Split:
    """vLLM's `qwen3`: `split_think`; thinking on unless `enable_thinking` is false."""
    return split_think(text, thinking=chat_template_kwargs.get("enable_thinking", True) is not False)


def split_nemotron(text: str, chat_template_kwargs: dict[str, Any]) -> Split:
    """vLLM's `nemotron_v3`: `deepseek_r1`'s split, and with `enable_thinking` false an answer-less split swapped
    (the text is the answer)."""
    reasoning, answer = split_think(text)
    if chat_template_kwargs.get("enable_thinking") is False and answer is None:
        return answer, reasoning
    return reasoning, answer


def split_granite(text: str, chat_template_kwargs: dict[str, Any]) -> Split:
    """vLLM's `granite`: the thought-process and response markers."""
    thought = GRANITE_THOUGHT.search(text)
    if thought is None:
        return None, text
    rest = text[thought.end() :]
    response = GRANITE_RESPONSE.search(rest)
    if response is None:
        return _or_none(rest), None
    return rest[: response.start()], _or_none(rest[response.end() :])


REASONING_PARSERS: dict[str, Callable[[str, dict[str, Any]], Split]] = {
    "deepseek_r1": split_deepseek_r1,
    "qwen3": split_qwen3,
    "granite": split_granite,
    "nemotron": split_nemotron,
    "nemotron_v3": split_nemotron,
}


def check_reasoning_parser(name: str | None) -> None:
    """`ValueError` naming the allowed parsers unless `name` is one (or None: no parser)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is unknown: must be one of {', '.join(REASONING_PARSERS)}")


def split_reasoning(name: str, text: str | None, chat_template_kwargs: dict[str, Any] | None = None) -> Split:
    """(reasoning, answer) of a generated `text` by the parser `name`; (None, None) for a row without text."""
    check_reasoning_parser(name)
    if text is None:
        return None, None
    return REASONING_PARSERS[name](text, chat_template_kwargs or {})
