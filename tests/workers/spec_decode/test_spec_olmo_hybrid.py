"""OLMo-Hybrid under speculative decoding: forced acceptance patterns leave every state equal to a fresh prefill of
the kept tokens, and greedy speculative output equals greedy plain output with n-gram, attention-only and hybrid
draft models (OLMo-Hybrid drafting for itself included) at batch 1, 5 and 16."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import engine_config
from tests.workers.model.olmo_hybrid_fixtures import build_olmo_hybrid
from tests.workers.spec_decode.test_greedy_exactness import _prompts as _spec_prompts
from tests.workers.spec_decode.test_state_shifting import PARAMS as FORCED_PARAMS
from tests.workers.spec_decode.test_state_shifting import (
    K,
    ScriptedProposer,
    _assert_slot_matches,
    _prompts,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.requests import Request
from workers.scheduler import Scheduler

PARAMS = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)  # shorter than test_greedy_exactness's: CI time


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory):
    return build_olmo_hybrid("olmo_hybrid", tmp_path_factory.mktemp("olmo_hybrid"))


def test_forced_acceptance_patterns_keep_states_exact(olmo_dir):
    runner = ModelRunner.from_pretrained(str(olmo_dir), max_num_seqs=4)
    prompts = _prompts()
    reference = {i: r.token_ids for i, r in enumerate(runner.generate(prompts, FORCED_PARAMS))}
    proposer = ScriptedProposer(reference, runner.config.vocab_size)
    requests = [
        Request(i, p, FORCED_PARAMS, frozenset(), torch.Generator().manual_seed(i), 512) for i, p in enumerate(prompts)
    ]
    scheduler = Scheduler(runner.model, engine_config(4, K), requests, proposer)
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:  # the slot covers every token but the newest
            _assert_slot_matches(scheduler.pool, request.slot, runner.model, (request.prompt + request.output)[:-1])
    for accepted, expected in proposer.seen:
        assert accepted == expected
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference


@pytest.fixture(scope="module")
def plain_outputs(olmo_dir):
    runner = ModelRunner.from_pretrained(str(olmo_dir), max_num_seqs=8)
    return {batch: [r.token_ids for r in runner.generate(_spec_prompts(batch, batch), PARAMS)] for batch in (1, 5, 16)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "batch"),
    [
        ("ngram", 1),
        ("ngram", 5),
        ("ngram", 16),
        ("draft_hybrid", 1),
        ("draft_hybrid", 5),
        ("draft_hybrid", 16),
        ("draft_attention", 16),
        ("self", 5),
    ],
)
def test_greedy_speculative_equals_greedy_plain(method, batch, olmo_dir, plain_outputs, checkpoint_dir):
    if method == "ngram":  # fixed k: the lookup keeps drafting wherever it matches
        speculative = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed")
    else:
        draft = olmo_dir if method == "self" else checkpoint_dir(method)
        speculative = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(draft))
    runner = ModelRunner.from_pretrained(str(olmo_dir), max_num_seqs=8, speculative=speculative)
    results = runner.generate(_spec_prompts(batch, batch), PARAMS)
    assert [r.token_ids for r in results] == plain_outputs[batch]
    stats = runner.spec_stats()
    assert stats["num_drafts"] > 0  # drafts were verified
    if method == "self":
        assert stats["acceptance_rate"] == 1.0  # a model drafting for itself is always right under greedy
