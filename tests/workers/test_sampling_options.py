"""The logits options (`workers/logits_processors.py`, min_p in `workers/sampling.py`) against independent
references: transformers' `generate` with its own logits processors (repetition penalty, min-new-tokens, bad words,
sequence bias, suppressed tokens for allowed_token_ids; min-p's warped distribution), a float64 loop of vLLM's
formula for the presence and frequency penalties; bad values refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.config import SamplingConfig
from pipeline.structured import sampling_fields
from tests.tiny_models import EOS
from tests.workers.test_oracle import assert_same_greedy
from workers import ModelRunner, SamplingParams
from workers.sampling import target_probs

FAMILY = "granite_dense"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WORD_IDS = list(range(4, 19))  # the tiny tokenizer's words (ids 19 … 127 decode to nothing)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    phrase = torch.randint(4, 128, (5,), generator=generator).tolist()
    return [phrase * 3, torch.randint(4, 128, (9,), generator=generator).tolist()]


@pytest.fixture(scope="module")
def runner(checkpoint_dir):
    return ModelRunner.from_pretrained(str(checkpoint_dir(FAMILY)), max_num_seqs=4)


@pytest.fixture(scope="module")
def hf(checkpoint_dir, hf_model):
    return hf_model(checkpoint_dir(FAMILY))


def hf_greedy(hf, prompt: list[int], max_new_tokens: int = MAX_TOKENS, **processors) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens with the given logits-processor arguments, and the top-2 margin of its processed
    scores at each step (a near-tie may flip)."""
    processors.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **processors,
        )
    margins = []
    for scores in out.scores:
        top = scores[0].topk(2).values
        margins.append(float(top[0] - top[1]) if torch.isfinite(top[1]) else float("inf"))
    return out.sequences[0, len(prompt) :].tolist(), margins


def assert_matches(runner, hf, params: SamplingParams, **processors) -> None:
    """Ours with `params` == transformers with `processors`, and different from plain greedy (the option acts)."""
    prompts = _prompts()
    plain = [r.token_ids for r in runner.generate(prompts, GREEDY)]
    results = runner.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        assert result.error is None, result.error
        assert_same_greedy(result.token_ids, *hf_greedy(hf, prompt, params.max_tokens, **processors))
    assert [r.token_ids for r in results] != plain


def test_repetition_penalty_matches_transformers(runner, hf):
    assert_matches(runner, hf, dataclasses.replace(GREEDY, repetition_penalty=1.8), repetition_penalty=1.8)


def test_logit_bias_matches_sequence_bias(runner, hf):
    bias = {13: 3.0, 40: 2.5, 77: -4.0}
    params = dataclasses.replace(GREEDY, logit_bias=bias)
    assert_matches(runner, hf, params, sequence_bias={(t,): b for t, b in bias.items()})


def test_allowed_token_ids_and_bad_words_match_transformers(runner, hf):
    """allowed_token_ids as transformers' suppressed tokens (every other id); bad words as its bad_words_ids: a
    one-token word banned always, a two-token word's second token banned right after its first."""
    allowed = dataclasses.replace(GREEDY, allowed_token_ids=tuple(WORD_IDS))
    suppress = [t for t in range(128) if t not in WORD_IDS]
    assert_matches(runner, hf, allowed, suppress_tokens=suppress)
    prompt = _prompts()[1]
    first = runner.generate([prompt], allowed)[0].token_ids
    words = runner.tokenizer.convert_ids_to_tokens(first)
    single = dataclasses.replace(allowed, bad_words=(words[0],))
    after_single = runner.generate([prompt], single)[0].token_ids
    assert first[0] not in after_single
    pair = runner.tokenizer.convert_ids_to_tokens(after_single[2:4])  # a word of two tokens the output holds
    assert prompt[-1] != after_single[2]  # transformers also matches the prompt; vLLM the output only
    both = dataclasses.replace(allowed, bad_words=(words[0], " ".join(pair)))
    ours = runner.generate([prompt], both)[0].token_ids
    bad_ids = [[first[0]], after_single[2:4]]
    assert_same_greedy(ours, *hf_greedy(hf, prompt, suppress_tokens=suppress, bad_words_ids=bad_ids))
    assert ours != after_single


def test_min_tokens_matches_min_new_tokens(runner, hf):
    """eos made likely by a bias: without min_tokens the rows stop at once; with it, eos and the stop token ids are
    masked until min_tokens tokens are out (transformers: min_new_tokens over the same stop ids)."""
    prompts = _prompts()
    stop_id = runner.generate(prompts[:1], GREEDY)[0].token_ids[0]
    base = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={EOS: 6.0}, stop_token_ids=(stop_id,))
    assert all(len(r.token_ids) == 1 for r in runner.generate(prompts, base))
    params = dataclasses.replace(base, min_tokens=5)
    stops = [EOS, stop_id]
    for prompt, result in zip(prompts, runner.generate(prompts, params)):
        reference, margins = hf_greedy(hf, prompt, min_new_tokens=5, eos_token_id=stops, sequence_bias={(EOS,): 6.0})
        assert_same_greedy(result.token_ids, reference, margins)
        assert len(result.token_ids) > 5 and result.finish_reason == "stop"


def vllm_penalties_greedy(hf, prompt: list[int], presence: float, frequency: float, repetition: float) -> list[int]:
    """Greedy under vLLM's `apply_penalties` in float64, one uncached forward per step: repetition over prompt and
    output (positive logits divided, the others multiplied), then − frequency · count − presence · [count > 0]."""
    output: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).double()
        seen = (counts > 0) | torch.bincount(torch.tensor(prompt), minlength=logits.shape[-1]).bool()
        penalty = torch.where(seen, repetition, 1.0).double()
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits - frequency * counts - presence * (counts > 0).double()
        output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize(
    "presence, frequency, repetition", [(1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (-0.5, 0.8, 1.3), (0.3, 0.0, 0.6)]
)
def test_presence_and_frequency_match_a_float64_reference(runner, hf, presence, frequency, repetition):
    prompts = _prompts()
    params = dataclasses.replace(
        GREEDY, presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition
    )
    results = [r.token_ids for r in runner.generate(prompts, params)]
    assert results == [vllm_penalties_greedy(hf, p, presence, frequency, repetition) for p in prompts]
    assert results != [r.token_ids for r in runner.generate(prompts, GREEDY)]


def test_min_p_keeps_transformers_warped_distribution():
    """min_p after temperature (vLLM's order): the distribution equals transformers' TemperatureLogitsWarper then
    MinPLogitsWarper; tokens below min_p · the top probability are never drawn."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)) * 3
    ids = torch.zeros(3, 1, dtype=torch.long)
    for min_p in (0.05, 0.3):
        ours = target_probs(logits, SamplingParams(temperature=0.7, min_p=min_p))
        warped = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(0.7)(ids, logits.clone()))
        assert torch.allclose(ours, warped.softmax(-1), atol=1e-6)
        assert ((ours > 0).sum(-1) < 128).all()


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_tokens", -1),
        ("min_tokens", 500),  # more than max_tokens
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {5: float("nan")}),
        ("logit_bias", {"x": 1.0}),
        ("bad_words", ("",)),
        ("allowed_token_ids", ()),
        ("allowed_token_ids", (3, -2)),
        ("allowed_token_ids", 5),
        ("bad_words", 5),
    ],
)
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="SamplingParams.max_tokens="):  # a bad neighbour does not break the checks
        SamplingParams(**{field: value, "max_tokens": "ten"})


def test_token_ids_beyond_the_vocabulary_fail_that_row_only(runner):
    params = [
        SamplingParams(max_tokens=4, logit_bias={128: 1.0}),
        SamplingParams(max_tokens=4, allowed_token_ids=(5, 300)),
        SamplingParams(max_tokens=4, logit_bias={"7": 1.0}, seed=1),  # JSON's string keys are token ids
    ]
    results = runner.generate([[5, 6, 7]] * 3, params)
    assert results[0].finish_reason == "error" and "logit_bias" in results[0].error and "128" in results[0].error
    assert results[1].finish_reason == "error" and "allowed_token_ids" in results[1].error
    assert results[2].error is None and len(results[2].token_ids) == 4


def test_job_flags_reach_sampling_params():
    from jobs.generate import SECTIONS
    from pipeline.cli import parse_sections

    argv = ["--input", "x", "--model", "m", "--output", "o", "--presence-penalty", "0.5", "--frequency-penalty", "1"]
    argv += ["--repetition-penalty", "1.2", "--min-p", "0.1", "--min-tokens", "3", "--logit-bias", '{"5": -2}']
    argv += [
        "--bad-words",
        "cat",
        "--bad-words",
        "big dog",
        "--allowed-token-ids",
        "4",
        "--allowed-token-ids",
        "[5, 6]",
    ]
    sampling = parse_sections("test", SECTIONS, argv)["sampling"]
    params = SamplingParams(**{k: v for k, v in sampling_fields(sampling).items() if k != "logprobs_mode"})
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 1.0, 1.2)
    assert (params.min_p, params.min_tokens, params.logit_bias) == (0.1, 3, {5: -2.0})
    assert params.bad_words == ("cat", "big dog") and params.allowed_token_ids == (4, 5, 6)
    with pytest.raises(ValueError, match="--allowed-token-ids"):
        SamplingConfig(allowed_token_ids=("five",))
    with pytest.raises(ValueError, match="--logit-bias"):
        SamplingConfig(logit_bias="[1, 2]")


def test_min_tokens_holds_stop_strings_back(runner):
    """vLLM's detokenizer checks stop strings only once the output is longer than min_tokens, and only in the text
    that is new then: the row stops at the first stop word after min_tokens tokens."""
    allowed = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=tuple(WORD_IDS))
    prompt = _prompts()[1]
    words = runner.tokenizer.convert_ids_to_tokens(runner.generate([prompt], allowed)[0].token_ids)
    stop = words[0]
    lengths = []
    for min_tokens in (0, 2, 6):
        result = runner.generate([prompt], dataclasses.replace(allowed, stop=(stop,), min_tokens=min_tokens))[0]
        expected = next((i + 1 for i, w in enumerate(words) if w == stop and i + 1 > min_tokens), MAX_TOKENS)
        assert len(result.token_ids) == expected, (min_tokens, words)
        assert result.finish_reason == ("stop" if expected < MAX_TOKENS or words[-1] == stop else "length")
        lengths.append(expected)
    assert len(set(lengths)) == 3, words  # each min_tokens changed where the row stops


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True])
def test_processed_logprobs_include_the_penalties(checkpoint_dir, hf, speculative):
    """processed_logprobs (vLLM: after every logits processor) are the log-softmax of the penalised logits, at every
    position, plain or speculative (verified positions after accepted drafts included); raw ones are not."""
    from workers import SpeculativeConfig

    spec = (
        SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(FAMILY)), policy="fixed") if speculative else None
    )
    path = str(checkpoint_dir(FAMILY))
    prompt = _prompts()[0]
    params = dataclasses.replace(
        GREEDY, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3, logprobs=2
    )
    for mode in ("processed", "raw"):
        runner = ModelRunner.from_pretrained(path, max_num_seqs=2, logprobs_mode=mode, speculative=spec)
        result = runner.generate([prompt], params)[0]
        assert result.token_ids == vllm_penalties_greedy(hf, prompt, 0.4, 0.7, 1.3)
        output = result.token_ids
        for position, (token, entry) in enumerate(zip(output, result.logprobs)):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + output[:position]])).logits[0, -1].double()
            if mode == "processed":
                counts = torch.bincount(torch.tensor(output[:position], dtype=torch.long), minlength=128).double()
                seen = (counts > 0) | torch.bincount(torch.tensor(prompt), minlength=128).bool()
                penalty = torch.where(seen, 1.3, 1.0).double()
                logits = torch.where(logits > 0, logits / penalty, logits * penalty)
                logits = logits - 0.7 * counts - 0.4 * (counts > 0).double()
            assert entry[token] == pytest.approx(float(logits.log_softmax(-1)[token]), abs=1e-4), (mode, position)
        if speculative:
            assert runner.spec_stats()["num_accepted_draft_tokens"] > 0
