"""Stop strings against a real byte-level BPE tokenizer (the demo's): characters whose bytes span tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from workers.requests import Request
from workers.sampling import SamplingParams, make_generator

DEMO = Path(__file__).parents[2] / "examples" / "models" / "demo-target"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO))


def _feed(tokenizer, text: str, stop: tuple[str, ...], include: bool = False) -> Request:
    """Append the tokens of `text` one by one, as decoding would, until the request stops."""
    params = SamplingParams(max_tokens=1000, stop=stop, include_stop_str_in_output=include)
    request = Request(0, [1], params, frozenset(), make_generator(params, "cpu", 0), 10_000)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if request.append(token, tokenizer):
            break
    return request


@pytest.mark.parametrize("stop", ["é", "。", "€", "😀", "ü", "fé", "é'", "ï", "naïve c", "€';"])
def test_stop_strings_with_multibyte_characters_fire(tokenizer, stop):
    text = "x = 'naïve café'; y = '€'; z = '。'; w = '😀ü'\nprint(x)\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))  # bytes really span tokens
    request = _feed(tokenizer, text, (stop,))
    assert request.finish_reason == "stop"
    assert request.text == text[: text.index(stop)]
    # It stopped at the first token whose text completes the stop string, not later.
    assert stop not in tokenizer.decode(request.output[:-1])


@pytest.mark.parametrize("stop", ["é", "😀", "naïve c", "€';"])
def test_a_kept_stop_string_spanning_tokens_ends_the_text(tokenizer, stop):
    text = "x = 'naïve café'; y = '€'; z = '。'; w = '😀ü'\nprint(x)\n"
    cut, kept = _feed(tokenizer, text, (stop,)), _feed(tokenizer, text, (stop,), include=True)
    assert kept.finish_reason == "stop" and kept.output == cut.output  # the same token completes it
    assert kept.result(tokenizer).text == text[: text.index(stop) + len(stop)]
    assert cut.result(tokenizer).text == text[: text.index(stop)]


def test_stop_string_that_never_occurs_runs_to_the_end(tokenizer):
    text = "x = 'naïve café'\n"
    request = _feed(tokenizer, text, ("ö", "cafe"))
    assert request.finish_reason is None and tokenizer.decode(request.output) == text
