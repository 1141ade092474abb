"""ModelRunner behaviour: seeds, slot reuse, stopping, bad prompts, text."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import EOS
from workers import ModelRunner, SamplingParams


@pytest.fixture(scope="module")
def runner(checkpoint_dir):
    return ModelRunner.from_pretrained(str(checkpoint_dir("granite_moe")), max_num_seqs=4)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 128, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(runner):
    prompts = _prompts(7)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = runner.generate([prompts[3]], params)[0].token_ids
    again = runner.generate([prompts[3]], params)[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=5 + i, ignore_eos=True) for i in range(7)]
    others[3] = params
    in_batch = runner.generate(prompts, others)[3].token_ids
    assert alone == again == in_batch
    other_seed = runner.generate([prompts[3]], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_slot_reuse_gives_the_same_tokens_as_running_alone(runner):
    prompts = _prompts(11, seed=1)  # 11 requests through 4 slots, finishing at different times
    params = [SamplingParams(temperature=0, max_tokens=3 + (i % 5) * 3, ignore_eos=True) for i in range(11)]
    batched = runner.generate(prompts, params)
    for prompt, p, result in zip(prompts, params, batched):
        assert result.token_ids == runner.generate([prompt], p)[0].token_ids
        assert len(result.token_ids) == p.max_tokens


def test_top_k_one_and_tiny_top_p_are_greedy(runner):
    prompts = _prompts(3, seed=2)
    greedy = [
        r.token_ids for r in runner.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ]
    top_k = runner.generate(prompts, SamplingParams(temperature=1.5, top_k=1, seed=0, max_tokens=8, ignore_eos=True))
    top_p = runner.generate(prompts, SamplingParams(temperature=1.5, top_p=1e-6, seed=0, max_tokens=8, ignore_eos=True))
    assert [r.token_ids for r in top_k] == greedy == [r.token_ids for r in top_p]


def test_bad_prompts_fail_alone(runner):
    good = [5, 6, 7]
    prompts = [good, [], list(range(4, 4 + 600)), [5, 128], good]
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [r.finish_reason for r in results] == ["length", "error", "error", "error", "length"]
    assert results[1].error == "prompt is empty"
    assert "more than max_model_len=512" in results[2].error
    assert "outside the vocabulary [0, 128)" in results[3].error
    assert results[0].token_ids == results[4].token_ids


def test_stop_token_ids_and_eos(runner):
    prompt = [5, 6, 7, 8]
    free = runner.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    stopped = runner.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"
    assert EOS in runner.eos_token_ids


def test_stop_strings_cut_the_text(runner):
    # Word-level tokenizer: every generated in-vocabulary token decodes to one word.
    prompt = runner.tokenizer.encode("the cat sat on the mat")
    free = runner.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop_word = words[2]
    result = runner.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_word]))[
        0
    ]
    assert result.finish_reason == "stop"
    assert stop_word not in result.text.split() and free.text.startswith(result.text.rstrip())


def test_max_model_len_ends_generation(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("bamba")), max_model_len=10)
    result = runner.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 4


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("seed", "x"),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_runner_arguments_are_validated(checkpoint_dir):
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        ModelRunner.from_pretrained(str(checkpoint_dir("bamba")), max_num_seqs=0)
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("bamba")))
    with pytest.raises(ValueError, match="one per prompt"):
        runner.generate([[5], [6]], [SamplingParams()])


def test_text_is_decoded_and_scoring_reports_bad_rows(runner):
    result = runner.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert result.text == runner.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    scores = runner.score([[5, 6, 7], [], [9]])
    assert len(scores[0].token_logprobs) == 2 and all(lp < 0 for lp in scores[0].token_logprobs)
    assert scores[1].error == "sequence is empty"
    assert scores[2].token_logprobs == [] and scores[2].error is None


def test_unseeded_requests_sample_independently_across_rows_and_runners(checkpoint_dir):
    path = str(checkpoint_dir("granite_moe"))
    params = SamplingParams(temperature=2.0, max_tokens=12, ignore_eos=True)  # flat: equal rows would be a repeat
    prompt = [5, 6, 7, 8]
    first = [r.token_ids for r in ModelRunner.from_pretrained(path).generate([prompt, prompt], params)]
    second = [r.token_ids for r in ModelRunner.from_pretrained(path).generate([prompt, prompt], params)]
    assert len({tuple(t) for t in first + second}) == 4


def test_a_prompt_of_max_model_len_tokens_gets_an_error_plain_and_speculative(checkpoint_dir):
    from workers import SpeculativeConfig

    path = str(checkpoint_dir("bamba"))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [5, 6, 7, 8, 5, 6, 7]]
    for spec in (None, SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=2)):
        full, one_short = ModelRunner.from_pretrained(path, max_model_len=8, speculative=spec).generate(prompts, params)
        assert (full.finish_reason, full.token_ids) == ("error", [])
        assert "max_model_len=8" in full.error and "no room to generate" in full.error
        assert (one_short.finish_reason, len(one_short.token_ids)) == ("length", 1)
    scores = ModelRunner.from_pretrained(path, max_model_len=8).score(prompts)  # scoring needs no room to generate
    assert scores[0].error is None and len(scores[0].token_logprobs) == 7


def test_seeds_are_taken_modulo_2_to_the_64(runner):
    prompt = [5, 6, 7, 8]
    sampled = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
        for seed in (5, 2**64 + 5, 2**64 - 1, -1)
    ]
    results = [r.token_ids for r in runner.generate([prompt] * 4, sampled)]
    assert results[0] == results[1] and results[2] == results[3]


def test_shard_seeds_near_2_to_the_64_do_not_overflow(runner):
    from dataclasses import replace

    from workers.rows import PromptSource, generate_shard

    rows = [{"text": "the cat"}, {"text": "a dog"}, {"text": "the cat"}]
    sampling = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2**64 - 1)
    columns = generate_shard(runner, rows, PromptSource(prompt_column="text"), sampling, first_row=0)
    assert columns["error"] == [None] * 3
    # Row i samples with seed + i modulo 2^64: row 1 uses seed 0, row 2 seed 1.
    again = generate_shard(runner, rows[1:], PromptSource(prompt_column="text"), replace(sampling, seed=0), 0)
    assert again["generated_token_ids"] == columns["generated_token_ids"][1:]
