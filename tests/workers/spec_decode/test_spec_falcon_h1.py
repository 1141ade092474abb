"""Speculative decoding on Falcon-H1: forced acceptance patterns leave every state (the parallel blocks' Mamba2
states and KV caches, the target's and a Falcon-H1 draft's) equal to a fresh prefill of the kept tokens, and greedy
speculative output equals greedy plain output with n-gram, attention-only and hybrid drafts at batch 1, 5 and 16."""

from __future__ import annotations

import pytest
import torch

from tests.falcon_h1_models import build_falcon_h1
from tests.tiny_models import build_checkpoint, engine_config
from tests.workers.spec_decode.test_greedy_exactness import _prompts as greedy_prompts
from tests.workers.spec_decode.test_state_shifting import (
    PARAMS,
    K,
    ScriptedProposer,
    _assert_slot_matches,
    _prompts,
    _requests,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.requests import Request
from workers.scheduler import Scheduler
from workers.spec_decode.draft_model import DraftModelProposer


class CappedProposer(ScriptedProposer):
    """The scripted proposer, expecting no more accepted tokens than a request has left to generate (the scheduler
    stops a request at max_tokens even when more of its drafts were right), and exactly one token on a step it was
    not asked to propose for (no request had room for a draft)."""

    def propose(self, requests, num_drafts):
        proposal = super().propose(requests, num_drafts)
        self.expected = [min(n, PARAMS.max_tokens - len(r.output)) for n, r in zip(self.expected, requests)]
        self.proposed = True
        return proposal

    def accepted(self, requests, num_accepted):
        if not getattr(self, "proposed", False):
            self.expected = [1] * len(requests)
        self.proposed = False
        super().accepted(requests, num_accepted)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """name → tiny checkpoint: the Falcon-H1 target (fused-kernel norm), a Falcon-H1 draft (no mixer norm, torch
    Mamba2 path) and an attention-only draft, all with the same tokenizer."""
    built = {name: build_falcon_h1(name, tmp_path_factory.mktemp(name)) for name in ("falcon_h1", "falcon_h1_no_norm")}
    built["draft_attention"] = build_checkpoint("draft_attention", tmp_path_factory.mktemp("draft_attention"))
    return built


def test_forced_acceptance_patterns_keep_states_exact(paths):
    runner = ModelRunner.from_pretrained(str(paths["falcon_h1"]), max_num_seqs=4)
    prompts = _prompts()[:5]
    reference = {i: r.token_ids for i, r in enumerate(runner.generate(prompts, PARAMS))}
    proposer = CappedProposer(reference, runner.config.vocab_size)
    scheduler = Scheduler(runner.model, engine_config(4, K), _requests(prompts), proposer)
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:  # the slot covers every token but the newest
            _assert_slot_matches(scheduler.pool, request.slot, runner.model, (request.prompt + request.output)[:-1])
    for accepted, expected in proposer.seen:
        assert accepted == expected
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference


def test_falcon_draft_state_is_shifted_to_what_it_has_seen(paths):
    target = ModelRunner.from_pretrained(str(paths["falcon_h1"]), max_num_seqs=3, linear_backend="torch")
    draft = ModelRunner.from_pretrained(str(paths["falcon_h1_no_norm"]), linear_backend="torch")
    prompts, params = _prompts(seed=3)[:3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = {i: r.token_ids for i, r in enumerate(target.generate(prompts, params))}
    proposer = DraftModelProposer(draft.model)
    requests = [
        Request(i, p, params, frozenset(), torch.Generator().manual_seed(i), 512) for i, p in enumerate(prompts)
    ]
    scheduler = Scheduler(target.model, engine_config(3, 3), requests, proposer)
    steps_checked = 0
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:
            covered = proposer.covered[request.slot]
            if covered:
                tokens = (request.prompt + request.output)[:covered]
                _assert_slot_matches(proposer.pool, request.slot, draft.model, tokens, dict(atol=1e-5, rtol=1e-4))
                steps_checked += 1
            _assert_slot_matches(scheduler.pool, request.slot, target.model, (request.prompt + request.output)[:-1])
    assert steps_checked > 4
    assert {r.index: r.output for r in scheduler.finished} == reference


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_greedy_speculative_equals_greedy_plain(batch, paths):
    """n-gram (fixed k: on random tiny models the adaptive policy soon stops asking), an attention-only draft and
    a Falcon-H1 draft (a hybrid draft whose own parallel blocks' states are shifted)."""
    target = str(paths["falcon_h1"])
    prompts = greedy_prompts(batch, batch)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = [r.token_ids for r in ModelRunner.from_pretrained(target, max_num_seqs=8).generate(prompts, params)]
    methods = {
        "ngram": SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed"),
        "attention draft": SpeculativeConfig("draft", 3, draft_model=str(paths["draft_attention"])),
        "falcon draft": SpeculativeConfig("draft", 3, draft_model=str(paths["falcon_h1_no_norm"])),
    }
    for method, speculative in methods.items():
        runner = ModelRunner.from_pretrained(target, max_num_seqs=8, speculative=speculative)
        results = runner.generate(prompts, params)
        assert [r.token_ids for r in results] == plain, method
        stats = runner.spec_stats()
        assert stats["num_drafts"] > 0, method  # drafts were proposed and verified
        assert sum(r.num_draft_tokens for r in results) == stats["num_draft_tokens"]
