"""Decode plans of Kimi-Linear (Kimi Delta Attention, multi-head latent attention, MoE or dense MLPs) against the
module-by-module native path, bit for bit: plain steps with changing batch sizes and reused slots, verification +
keep under accepted patterns, forced acceptance through the scheduler (every state and latent cache entry equal to
a fresh prefill of the kept tokens), greedy generation plain and speculative (n-gram, draft models)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.model.plan_checks import (
    GREEDY,
    NGRAM,
    PROMPTS,
    assert_forced_acceptance_keeps_prefill_states,
    assert_plan_steps_equal_module_steps,
    assert_speculation_equals,
    assert_verification_and_keep_equal_module_steps,
    clone,
    generate,
    random_pool,
    recording,
)
from workers import ModelRunner, SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason

FAMILIES = ["kimi_linear", "kimi_linear_qlora", "kimi_linear_dense", "kimi_linear_odd", "kimi_linear_wide"]


def test_kimi_models_are_covered_and_the_others_say_why(checkpoint_dir):
    for family in FAMILIES:
        assert unsupported_reason(load_checkpoint(str(checkpoint_dir(family))).model) is None, family
    model = load_checkpoint(str(checkpoint_dir("kimi_linear"))).model
    next(b for b in model.blocks if b.kind == "kda").mixer.decode_kernel = "torch"
    assert unsupported_reason(model) == "Kimi Delta Attention decode steps do not run through the native kernel"
    model = load_checkpoint(str(checkpoint_dir("kimi_linear_qlora"))).model
    model.blocks[0].mixer.native = False
    assert unsupported_reason(model) == "latent attention decode steps do not run through the native kernel"
    torch_model = load_checkpoint(str(checkpoint_dir("kimi_linear_dense")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_steps_equal_the_module_path_bit_for_bit(checkpoint_dir, family):
    model = load_checkpoint(str(checkpoint_dir(family))).model
    reference = random_pool(model, slots=4, capacity=40, seed=0, ssm_scale=0.3)
    # Batch sizes change between steps (requests finish, slots are reused); positions cross KV block boundaries.
    assert_plan_steps_equal_module_steps(model, reference, [3, 3, 4, 2, 1, 4, 4], 40, lambda step: min(step + 33, 39))


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(checkpoint_dir, family, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows."""
    model = load_checkpoint(str(checkpoint_dir(family))).model
    stepped = random_pool(model, slots=3, capacity=32, seed=2, ssm_scale=0.3)
    # Row 2's tokens cross a KV block boundary (16).
    assert_verification_and_keep_equal_module_steps(model, stepped, accepted, [5, 0, 14])


def test_a_latent_attention_step_at_a_position_without_a_block_is_refused(checkpoint_dir):
    model = load_checkpoint(str(checkpoint_dir("kimi_linear_qlora"))).model  # latent attention is its first layer
    pool = random_pool(model, slots=2, capacity=32, seed=4)
    pool.blocks.tables[1, 1] = 0  # slot 1 has no block for positions 16 … 31
    before = clone(pool)
    plan = DecodePlan(model, pool)
    with pytest.raises(ValueError, match="without a KV block"):
        plan.run([5, 6], [3, 20])
    assert torch.equal(pool.key, before.key) and torch.equal(pool.ssm, before.ssm)  # refused before any write


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_through_plans_equals_the_module_path(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    expected, _ = generate(path, decode_plan=False)
    plain, runner = generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    assert_speculation_equals(path, NGRAM, expected)
    # The module path verifies natively too (KDA's verify and keep kernels, latent attention's kernel).
    module_spec = ModelRunner.from_pretrained(path, max_num_seqs=3, speculative=NGRAM, decode_plan=False)
    assert [r.token_ids for r in module_spec.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("draft", ["kimi_linear_dense", "draft_hybrid"])
def test_draft_models_step_through_their_own_plans(checkpoint_dir, draft, monkeypatch):
    """Draft-model speculation for a Kimi-Linear target: a Kimi-Linear draft (KDA and latent attention planned on
    both sides) and a Mamba2 hybrid draft; greedy output equals plain greedy output."""
    path = str(checkpoint_dir("kimi_linear"))
    draft_path = str(checkpoint_dir(draft) if draft.startswith("kimi") else checkpoint_dir(draft))
    expected, _ = generate(path, decode_plan=False)
    plans: list[DecodePlan] = []
    monkeypatch.setattr(DecodePlan, "__init__", recording(DecodePlan.__init__, plans))
    got, runner = generate(path, speculative=SpeculativeConfig("draft", 3, draft_model=draft_path, policy="fixed"))
    assert got == expected and runner.spec_stats()["num_draft_tokens"] > 0
    assert "kimi_linear" in {plan.model.config.model_type for plan in plans}
    if draft.startswith("kimi"):
        assert len({id(plan.model) for plan in plans}) == 2  # the draft runs its own plan


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_linear_odd", "kimi_linear_wide"])
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(checkpoint_dir, family):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, every slot holds the states and latent cache of a fresh
    prefill of its tokens, and the output is plain greedy decoding's."""
    assert_forced_acceptance_keeps_prefill_states(checkpoint_dir(family))
