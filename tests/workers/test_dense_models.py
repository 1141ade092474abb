"""Attention-only standard models (Llama, Mistral, Qwen2, Qwen3, Granite): exact against transformers, and as draft
models of every hybrid family, greedy speculative output equal to plain."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from tests.tiny_models import DENSE_FAMILIES, draft_for
from tests.workers.test_oracle import _hf_greedy, _hf_logprobs, _prompts, assert_same_greedy
from workers import ModelRunner, SamplingParams, SpeculativeConfig

DENSE = sorted(DENSE_FAMILIES)


@pytest.mark.parametrize("family", DENSE)
def test_dense_scores_and_greedy_match_transformers(family, checkpoint_dir, hf_model):
    path = checkpoint_dir(family)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=3)
    sequences = _prompts(1, [2, 9, 16, 33, 48, 5])
    worst = 0.0
    for seq, score in zip(sequences, runner.score(sequences)):
        worst = max(worst, (torch.tensor(score.token_logprobs) - _hf_logprobs(hf_model(path), seq)).abs().max().item())
    assert worst < 1e-4
    assert torch.tensor(runner.score([sequences[4]])[0].token_logprobs).std() > 0.1  # the input matters
    prompts = _prompts(2, [1, 7, 20, 3])
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        reference, margins = _hf_greedy(hf_model(path), prompt, 10)
        assert_same_greedy(result.token_ids, reference, margins)


def test_sliding_window_caps_the_model_length(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("mistral")))
    assert runner.max_model_len == 64  # the window: full attention is exact up to it
    result = runner.generate([[5] * 64], SamplingParams(temperature=0, max_tokens=4))[0]
    assert result.finish_reason == "error" and "max_model_len=64" in result.error


@pytest.fixture(scope="module")
def plain_greedy(checkpoint_dir):
    cache: dict[str, list[list[int]]] = {}

    def get(family: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        if family not in cache:
            runner = ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=4)
            cache[family] = [r.token_ids for r in runner.generate(prompts, params)]
        return cache[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["granite", "llama", "qwen3"])
@pytest.mark.parametrize("target", ALL_FAMILIES)
def test_dense_drafts_keep_greedy_speculation_exact_on_every_hybrid(target, draft, checkpoint_dir, plain_greedy):
    prompts = [p * 3 for p in _prompts(3, [4, 2, 7, 1, 5])]  # repeats: some drafts get accepted
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(draft_for(target, draft))), policy="fixed")
    runner = ModelRunner.from_pretrained(str(checkpoint_dir(target)), max_num_seqs=4, speculative=spec)
    assert [r.token_ids for r in runner.generate(prompts, params)] == plain_greedy(target, prompts, params)
    assert runner.spec_stats()["num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_dense_targets_speculate_exactly(method, checkpoint_dir, plain_greedy):
    prompts = [p * 3 for p in _prompts(3, [4, 2, 7, 1, 5])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    draft = str(checkpoint_dir("qwen3")) if method == "draft" else None
    spec = SpeculativeConfig(method, 3, draft_model=draft, prompt_lookup_min=1, policy="fixed")
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("llama")), max_num_seqs=4, speculative=spec)
    assert [r.token_ids for r in runner.generate(prompts, params)] == plain_greedy("llama", prompts, params)
    assert runner.spec_stats()["num_draft_tokens"] > 0
