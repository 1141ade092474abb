"""The output-text options against real tokenizers: skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output (stop strings kept or cut, spanning tokens, fed token by token as decoding does)."""

from __future__ import annotations

import pytest

from tests.tiny_models import EOS, make_tokenizer
from workers.requests import Request
from workers.sampling import SamplingParams, make_generator


@pytest.fixture(scope="module")
def tokenizer():
    """The word-level test tokenizer (decode joins tokens with spaces) with two added special tokens."""
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tokenizer


def _feed(tokenizer, text: str, stop_token_ids=frozenset(), **options) -> Request:
    """Append the tokens of `text` one by one until the request stops (`options`: SamplingParams fields)."""
    params = SamplingParams(max_tokens=1000, **options)
    request = Request(0, [1], params, frozenset(stop_token_ids), make_generator(params, "cpu", 0), 10_000)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if request.append(token, tokenizer):
            break
    return request


def _text(tokenizer, text: str, **options) -> str:
    return _feed(tokenizer, text, **options).result(tokenizer).text


def test_skip_special_tokens_on_by_default_and_off(tokenizer):
    text = "the <think> a </think> cat"
    assert _text(tokenizer, text) == "the a cat"
    assert _text(tokenizer, text, skip_special_tokens=False) == "the <think> a </think> cat"


def test_spaces_between_special_tokens(tokenizer):
    text = "the <think> </think> <eos> cat"
    assert _text(tokenizer, text, skip_special_tokens=False) == "the <think> </think> <eos> cat"
    # Off: adjacent added tokens touch; an added token after a word keeps its space, as vLLM's detokenizer does.
    off = _text(tokenizer, text, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert off == "the <think></think><eos> cat"
    # With special tokens skipped the option changes nothing.
    assert _text(tokenizer, text, spaces_between_special_tokens=False) == "the cat"


@pytest.mark.parametrize("stop", ["cat", "a cat", "cat sat on"], ids=["one-token", "two-tokens", "three-tokens"])
def test_a_stop_string_is_cut_or_kept(tokenizer, stop):
    text = "the dog a cat sat on the mat"
    cut = _feed(tokenizer, text, stop=(stop,))
    kept = _feed(tokenizer, text, stop=(stop,), include_stop_str_in_output=True)
    # Both stop at the token that completes the stop string, with the same tokens.
    completing = len((text[: text.index(stop) + len(stop)]).split())
    assert len(cut.output) == len(kept.output) == completing
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.result(tokenizer).text == text[: text.index(stop)]
    assert kept.result(tokenizer).text == text[: text.index(stop) + len(stop)]


def test_a_stop_string_inside_a_token_keeps_what_the_token_adds_only_when_kept(tokenizer):
    # "ca" ends inside "cat"'s text: cut before it, or kept up to its end (the rest of the token's text dropped).
    assert _text(tokenizer, "the cat sat", stop=("ca",)) == "the "
    assert _text(tokenizer, "the cat sat", stop=("ca",), include_stop_str_in_output=True) == "the ca"


def test_a_special_token_stop_string_fires_only_when_special_tokens_are_in_the_text(tokenizer):
    text = "the <think> a </think> cat sat"
    skipped = _feed(tokenizer, text, stop=("</think>",))
    assert skipped.finish_reason is None and skipped.result(tokenizer).text == "the a cat sat"
    kept = _feed(tokenizer, text, stop=("</think>",), skip_special_tokens=False)
    assert kept.finish_reason == "stop" and kept.result(tokenizer).text == "the <think> a "
    both = _feed(tokenizer, text, stop=("</think>",), skip_special_tokens=False, include_stop_str_in_output=True)
    assert both.result(tokenizer).text == "the <think> a </think>"


def test_a_final_stop_token_is_in_the_text_only_when_kept(tokenizer):
    text = "the cat <eos> sat"
    options = dict(stop_token_ids={EOS}, skip_special_tokens=False)
    assert _text(tokenizer, text, **options) == "the cat"
    assert _text(tokenizer, text, **options, include_stop_str_in_output=True) == "the cat <eos>"


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"])
def test_the_options_take_booleans_only(name):
    with pytest.raises(ValueError, match=rf"SamplingParams.{name}=1 is invalid: must be True or False"):
        SamplingParams(**{name: 1})


@pytest.mark.slow
@pytest.mark.parametrize("include", [False, True], ids=["cut", "kept"])
def test_runner_stops_at_a_stop_string_spanning_tokens_plain_and_speculative(checkpoint_dir, include):
    from workers import ModelRunner, SpeculativeConfig

    path = str(checkpoint_dir("granite_moe"))
    speculative = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")
    plain, spec = ModelRunner.from_pretrained(path), ModelRunner.from_pretrained(path, speculative=speculative)
    prompt = plain.tokenizer.encode("the the the the")
    free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    # The tiny model's vocabulary is a few words (other ids decode to nothing): two words of the free text come
    # from tokens apart, so the stop string spans several tokens; late enough that drafts are proposed before it.
    words = free.split()
    assert len(words) >= 3, free
    stop = " ".join(words[-2:])
    end = free.index(stop) + (len(stop) if include else 0)
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
    )
    results = [runner.generate([prompt], params)[0] for runner in (plain, spec)]
    assert results[0].text == free[:end] and results[0].finish_reason == "stop"
    assert (results[1].text, results[1].token_ids) == (results[0].text, results[0].token_ids)
    assert results[1].num_drafts > 0  # it really verified drafts
