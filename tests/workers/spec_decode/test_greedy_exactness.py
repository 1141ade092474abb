"""Greedy speculative output == greedy plain output, token for token: every family × proposer × batch size."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from tests.tiny_models import draft_for
from workers import ModelRunner, SamplingParams, SpeculativeConfig

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(batch: int, seed: int) -> list[list[int]]:
    """Ragged prompts; half of them repeat a phrase so that n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch):
        phrase = torch.randint(4, 128, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append(phrase * 4 if i % 2 == 0 else phrase + [5] * (i % 3))  # row 0 repeats: batch 1 drafts too
    return prompts


def _speculative(method: str, family: str, checkpoint_dir) -> SpeculativeConfig:
    if method.startswith("ngram"):  # "ngram-fixed": always 4 drafts where the lookup finds them
        policy = "fixed" if method == "ngram-fixed" else "adaptive"
        return SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy=policy)
    draft = draft_for(family, {"self": family, "attention": "draft_attention", "hybrid": "draft_hybrid"}[method])
    return SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(checkpoint_dir(draft)))


@pytest.fixture(scope="module")
def plain_outputs(checkpoint_dir):
    cache: dict[tuple[str, int], list[list[int]]] = {}

    def get(family: str, batch: int) -> list[list[int]]:
        if (family, batch) not in cache:
            runner = ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=8)
            cache[family, batch] = [r.token_ids for r in runner.generate(_prompts(batch, batch), PARAMS)]
        return cache[family, batch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("method", ["ngram", "ngram-fixed", "self", "attention", "hybrid"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_greedy_speculative_equals_greedy_plain(family, method, batch, checkpoint_dir, plain_outputs):
    """With the adaptive policy (the default) and, for n-gram, the fixed one: on random tiny models the lookup
    rarely matches the output, so the adaptive policy soon stops asking, while fixed k keeps verifying."""
    speculative = _speculative(method, family, checkpoint_dir)
    runner = ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=8, speculative=speculative)
    results = runner.generate(_prompts(batch, batch), PARAMS)
    assert [r.token_ids for r in results] == plain_outputs(family, batch)
    stats = runner.spec_stats()
    assert sum(n for k, n in stats["num_steps_by_k"].items() if k) > 0  # the policy asked for drafts
    if method != "ngram":
        assert stats["num_drafts"] > 0  # and verified them
    if method == "self":
        assert stats["acceptance_rate"] == 1.0  # a model drafting for itself is always right under greedy
    assert sum(r.num_draft_tokens for r in results) == stats["num_draft_tokens"]
