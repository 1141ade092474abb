"""LFM2 / LFM2-MoE / LFM3 under speculative decoding: forced acceptance patterns leave every state (conv windows,
KV caches) equal to a fresh prefill of the kept tokens, and greedy speculative output equals greedy plain output
with n-gram drafts, an attention-only draft model and hybrid draft models (LFM2 itself drafting, its short-conv
windows shifted on the draft side too)."""

from __future__ import annotations

import pytest
import torch

from tests.lfm_models import lfm_checkpoint  # noqa: F401 (a fixture)
from tests.tiny_models import engine_config
from tests.workers.spec_decode import test_state_shifting
from tests.workers.spec_decode.test_greedy_exactness import _prompts as _spec_prompts
from tests.workers.spec_decode.test_state_shifting import (
    _assert_slot_matches,
    assert_forced_acceptance_exact,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.requests import Request
from workers.scheduler import Scheduler
from workers.spec_decode.draft_model import DraftModelProposer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Four of the state-shifting test's ragged prompts (1 … 17 tokens; LFM3's window is 8)."""
    return test_state_shifting._prompts(seed)[:4]


def _requests(prompts: list[list[int]]) -> list[Request]:
    return [Request(i, p, GREEDY, frozenset(), torch.Generator().manual_seed(i), 512) for i, p in enumerate(prompts)]


# LFM2-MoE's routing adds nothing to the state a step shifts: its exactness is the plain path's (and spec == plain).
@pytest.mark.parametrize("family", ["lfm2", "lfm3"])
def test_forced_acceptance_patterns_keep_states_exact(family, lfm_checkpoint):  # noqa: F811
    assert_forced_acceptance_exact(ModelRunner.from_pretrained(str(lfm_checkpoint(family)), max_num_seqs=4))


def test_lfm2_draft_windows_are_shifted_to_what_it_has_seen(lfm_checkpoint):  # noqa: F811
    """An LFM2 draft for an LFM3 target: after every step the draft's conv windows and KV equal a fresh prefill of
    the tokens it has covered."""
    target = ModelRunner.from_pretrained(str(lfm_checkpoint("lfm3")), max_num_seqs=3, linear_backend="torch")
    draft = ModelRunner.from_pretrained(str(lfm_checkpoint("lfm2")), linear_backend="torch")
    prompts = _prompts(seed=3)
    reference = {i: r.token_ids for i, r in enumerate(target.generate(prompts, GREEDY))}
    proposer = DraftModelProposer(draft.model)
    scheduler = Scheduler(target.model, engine_config(3, 3), _requests(prompts), proposer)
    steps_checked = 0
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:
            covered = proposer.covered[request.slot]
            if covered:
                tokens = (request.prompt + request.output)[:covered]
                _assert_slot_matches(proposer.pool, request.slot, draft.model, tokens, dict(atol=1e-5, rtol=1e-4))
                steps_checked += 1
    assert steps_checked > 6
    assert {r.index: r.output for r in scheduler.finished} == reference


# (target, method, batch): each proposer kind and batch size 1, 5 and 16 at least once, each family a few times.
CASES = [
    ("lfm2", "ngram", 16),
    ("lfm2", "draft_attention", 5),
    ("lfm2", "draft_hybrid", 1),
    ("lfm2_moe", "ngram", 5),
    ("lfm2_moe", "lfm2", 1),
    ("lfm3", "ngram", 5),
    ("lfm3", "lfm2", 5),
    ("lfm3", "draft_attention", 1),
]


@pytest.mark.parametrize("family, method, batch", CASES)
def test_greedy_speculative_equals_greedy_plain(family, method, batch, lfm_checkpoint, checkpoint_dir):  # noqa: F811
    prompts = _spec_prompts(batch, batch)
    plain = ModelRunner.from_pretrained(str(lfm_checkpoint(family)), max_num_seqs=8).generate(prompts, GREEDY)
    if method == "ngram":  # fixed k: every step where the lookup finds a match verifies 4 drafts
        speculative = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed")
    else:
        draft = lfm_checkpoint(method) if method.startswith("lfm") else checkpoint_dir(method)
        speculative = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(draft))
    runner = ModelRunner.from_pretrained(str(lfm_checkpoint(family)), max_num_seqs=8, speculative=speculative)
    results = runner.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    stats = runner.spec_stats()
    assert stats["num_drafts"] > 0  # drafts were verified
