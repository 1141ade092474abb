"""Kimi-Linear under speculative decoding: forced acceptance patterns leave every Kimi Delta Attention state and
latent cache equal to a fresh prefill of the kept tokens, and greedy speculative output equals greedy plain output
with n-gram drafts and draft models (attention-only, Mamba2 hybrid, and another Kimi-Linear: a KDA draft whose own
states are shifted)."""

from __future__ import annotations

import pytest

from tests.tiny_models import engine_config
from tests.workers.spec_decode.test_greedy_exactness import _prompts as spec_prompts
from tests.workers.spec_decode.test_state_shifting import (
    _assert_slot_matches,
    _prompts,
    _requests,
    assert_forced_acceptance_exact,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.scheduler import Scheduler
from workers.spec_decode.draft_model import DraftModelProposer

SPEC_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_forced_acceptance_patterns_keep_states_exact(checkpoint_dir):
    assert_forced_acceptance_exact(ModelRunner.from_pretrained(str(checkpoint_dir("kimi_linear")), max_num_seqs=4))


def test_kimi_draft_state_is_shifted_to_what_it_has_seen(checkpoint_dir):
    """A Kimi-Linear draft (KDA and latent attention, no experts) for a small attention-only target: after every
    step the draft's states and latent cache equal a fresh prefill of the tokens it has seen."""
    target = ModelRunner.from_pretrained(str(checkpoint_dir("draft_attention")), max_num_seqs=3, linear_backend="torch")
    draft_runner = ModelRunner.from_pretrained(str(checkpoint_dir("kimi_linear_dense")), linear_backend="torch")
    prompts = _prompts(seed=3)[:3]
    proposer = DraftModelProposer(draft_runner.model)
    scheduler = Scheduler(target.model, engine_config(3, 3), _requests(prompts), proposer)
    steps_checked = 0
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:
            covered = proposer.covered[request.slot]
            if covered:
                tokens = (request.prompt + request.output)[:covered]
                _assert_slot_matches(proposer.pool, request.slot, draft_runner.model, tokens)
                steps_checked += 1
    assert steps_checked > 6


@pytest.fixture(scope="module")
def plain_outputs(checkpoint_dir):
    cache: dict[int, list[list[int]]] = {}

    def get(batch: int) -> list[list[int]]:
        if batch not in cache:
            runner = ModelRunner.from_pretrained(str(checkpoint_dir("kimi_linear")), max_num_seqs=8)
            cache[batch] = [r.token_ids for r in runner.generate(spec_prompts(batch, batch), SPEC_PARAMS)]
        return cache[batch]

    return get


@pytest.mark.parametrize(
    ("method", "batch"),
    [("ngram-fixed", 1), ("ngram", 5), ("ngram", 16), ("attention", 5), ("hybrid", 16), ("kimi", 1)],
)
def test_greedy_speculative_equals_greedy_plain(method, batch, checkpoint_dir, plain_outputs):
    if method.startswith("ngram"):
        policy = "fixed" if method == "ngram-fixed" else "adaptive"
        speculative = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy=policy)
    else:
        draft = checkpoint_dir("kimi_linear_qlora") if method == "kimi" else checkpoint_dir(f"draft_{method}")
        speculative = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(draft))
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("kimi_linear")), max_num_seqs=8, speculative=speculative)
    results = runner.generate(spec_prompts(batch, batch), SPEC_PARAMS)
    assert [r.token_ids for r in results] == plain_outputs(batch)
    stats = runner.spec_stats()
    assert sum(n for k, n in stats["num_steps_by_k"].items() if k) > 0  # the policy asked for drafts
    if method != "ngram":
        assert stats["num_drafts"] > 0  # and verified them
