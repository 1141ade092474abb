"""Reasoning parsers split every form (closed, unclosed, absent) on every family's spelling, as vLLM's do."""

from __future__ import annotations

import pytest

from workers.chat import ChatOptions
from workers.reasoning import REASONING_PARSERS, check_reasoning_parser, split_reasoning

THINK_FAMILIES = ["qwen3", "deepseek_r1", "nemotron", "nemotron_v3"]


@pytest.mark.parametrize("name", THINK_FAMILIES)
@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>\nweigh it\n</think>\n\nThe answer is 4.", ("\nweigh it\n", "\n\nThe answer is 4.")),
        # The template opened the thought in the prompt: the output starts inside it.
        ("weigh it</think>4", ("weigh it", "4")),
        # Closed, nothing after: the answer is None (vLLM's `content or None`).
        ("<think>weigh it</think>", ("weigh it", None)),
        # Cut by max_tokens mid-thought: all of it is reasoning.
        ("<think>weigh it and then", ("weigh it and then", None)),
        ("weigh it and then", ("weigh it and then", None)),
        # Only the first </think> ends the thought.
        ("a</think>b</think>c", ("a", "b</think>c")),
    ],
    ids=["closed", "opened-in-prompt", "closed-empty-answer", "unclosed", "unclosed-no-tags", "two-ends"],
)
def test_think_tag_families(name, text, expected):
    assert split_reasoning(name, text) == expected


@pytest.mark.parametrize("name", ["qwen3", "nemotron", "nemotron_v3"])
def test_thinking_switched_off_makes_an_unclosed_text_the_answer(name):
    off = {"enable_thinking": False}
    assert split_reasoning(name, "The answer is 4.", off) == (None, "The answer is 4.")
    # A closed thought is still split.
    assert split_reasoning(name, "<think></think>4", off) == ("", "4")
    # deepseek_r1 has no switch: unclosed is reasoning whatever the kwargs say.
    assert split_reasoning("deepseek_r1", "The answer is 4.", off) == ("The answer is 4.", None)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Here is my thought process: add them. Here is my response: 4", (" add them. ", " 4")),
        ("Here's my thought process:add them.Here's my response:4", ("add them.", "4")),
        ("Here is my thought process: add them. Here's my response:", (" add them. ", None)),
        ("Here is my thought process: add them and", (" add them and", None)),  # cut mid-thought
        ("The answer is 4.", (None, "The answer is 4.")),  # no thought: all answer
        ("<think>x</think>4", (None, "<think>x</think>4")),  # another family's tags mean nothing here
    ],
    ids=["closed", "heres", "closed-empty-answer", "unclosed", "absent", "other-tags"],
)
def test_granite(text, expected):
    assert split_reasoning("granite", text) == expected


def test_a_row_without_text_and_unknown_names():
    for name in REASONING_PARSERS:
        assert split_reasoning(name, None) == (None, None)
    with pytest.raises(ValueError, match="'qwen' is unknown: must be one of deepseek_r1, qwen3, granite, nemotron"):
        check_reasoning_parser("qwen")
    with pytest.raises(ValueError, match="must be one of"):
        ChatOptions(reasoning_parser="r1")


def test_chat_options_split_read_enable_thinking():
    assert ChatOptions(reasoning_parser="qwen3").split("abc") == ("abc", None)
    off = ChatOptions(chat_template_kwargs={"enable_thinking": False}, reasoning_parser="qwen3")
    assert off.split("abc") == (None, "abc")
