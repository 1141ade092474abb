"""Zamba2 speculative decoding: forced acceptance patterns leave every state (recurrent, and the KV cache of every
use of a shared block) equal to a fresh prefill; greedy speculative == greedy plain with n-gram and draft models."""

from __future__ import annotations

import pytest

from tests.workers.spec_decode import test_greedy_exactness as exactness
from tests.workers.spec_decode.test_state_shifting import assert_forced_acceptance_exact
from tests.zamba2_models import build_zamba2
from workers import ModelRunner


@pytest.fixture(scope="module")
def zamba2_path(tmp_path_factory):
    """The adapter + RoPE layout (its first layer is hybrid; uses 0 and 2 share a block)."""
    return build_zamba2("zamba2_lora", tmp_path_factory.mktemp("zamba2_lora"))


def test_forced_acceptance_patterns_keep_states_exact(zamba2_path):
    assert_forced_acceptance_exact(ModelRunner.from_pretrained(str(zamba2_path), max_num_seqs=4))


@pytest.fixture(scope="module")
def plain_outputs(zamba2_path):
    """batch size → the greedy plain outputs of `exactness._prompts(batch, batch)`."""
    runner = ModelRunner.from_pretrained(str(zamba2_path), max_num_seqs=8)
    return {b: runner.generate(exactness._prompts(b, b), exactness.PARAMS) for b in (1, 5, 16)}


CASES = [("ngram-fixed", 1), ("ngram-fixed", 5), ("ngram-fixed", 16), ("attention", 5), ("hybrid", 1), ("hybrid", 16)]


@pytest.mark.parametrize(("method", "batch"), CASES)
def test_greedy_speculative_equals_greedy_plain(method, batch, zamba2_path, checkpoint_dir, plain_outputs):
    """n-gram drafts (fixed k: verification every step) and draft models without and with recurrent layers (the
    hybrid draft's own states are shifted too), at batch 1, 5 and 16."""
    prompts = exactness._prompts(batch, batch)
    plain = plain_outputs[batch]
    speculative = exactness._speculative(method, "zamba2", checkpoint_dir)
    runner = ModelRunner.from_pretrained(str(zamba2_path), max_num_seqs=8, speculative=speculative)
    results = runner.generate(prompts, exactness.PARAMS)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    stats = runner.spec_stats()
    assert stats["num_drafts"] > 0 and sum(n for k, n in stats["num_steps_by_k"].items() if k) > 0
