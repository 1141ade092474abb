"""Decode plans of LFM2 / LFM2-MoE / LFM3 (short convs, per-head q/k norms, LFM3's sandwich norms, per-head output
gates, sliding-window layers, proportional RoPE) and OLMo-Hybrid (post-norm attention blocks, whole-width q/k norms,
beta = 2·sigmoid(b) Gated DeltaNets; NoPE and RoPE) against the module-by-module native path, bit for bit: decode
steps with changing batch sizes and positions past the sliding window, verification + keep under forced acceptance
patterns, greedy generation plain and speculative (n-gram, attention draft, hybrid draft)."""

from __future__ import annotations

import pytest

from tests.workers.model.plan_checks import (
    NGRAM,
    assert_forced_acceptance_keeps_prefill_states,
    assert_plan_steps_equal_module_steps,
    assert_speculation_equals,
    assert_verification_and_keep_equal_module_steps,
    generate,
    random_pool,
    recording,
)
from workers import SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason

LFM = ["lfm2", "lfm2_untied", "lfm2_moe", "lfm3"]
OLMO = ["olmo_hybrid", "olmo_hybrid_rope"]
FAMILIES = LFM + OLMO


def test_the_families_are_covered_and_the_torch_kernels_say_why(checkpoint_dir):
    for family in FAMILIES:
        model = load_checkpoint(str(checkpoint_dir(family))).model
        assert unsupported_reason(model) is None, family
    lfm3 = load_checkpoint(str(checkpoint_dir("lfm3"))).model
    windows = {block.mixer.config.sliding_window for block in lfm3.blocks if block.kind == "attention"}
    assert windows == {None, 8} and lfm3.config.sandwich_norms  # the layouts these tests rely on
    olmo = load_checkpoint(str(checkpoint_dir("olmo_hybrid"))).model
    assert olmo.config.gdn.beta_scale == 2.0 and olmo.config.post_norm_blocks
    assert all(m.decode_kernel == "native" for m in olmo.modules() if hasattr(m, "decode_kernel"))
    lfm3.blocks[0].mixer.decode_kernel = "torch"
    assert unsupported_reason(lfm3) == "short-conv decode steps do not run through the native kernel"
    torch_model = load_checkpoint(str(checkpoint_dir("olmo_hybrid")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_steps_equal_the_module_path_bit_for_bit(checkpoint_dir, family):
    model = load_checkpoint(str(checkpoint_dir(family))).model
    reference = random_pool(model, slots=4, capacity=40, seed=0, ssm_scale=0.3)  # LFM: an empty ssm buffer
    # Batch sizes change between steps; positions run from inside LFM3's window of 8 to far past it.
    assert_plan_steps_equal_module_steps(
        model, reference, [3, 3, 4, 2, 1, 4, 4], 40, lambda step: min(step * 6 + 2, 39)
    )


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(checkpoint_dir, family, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows; one
    row's tokens cross LFM3's sliding window."""
    model = load_checkpoint(str(checkpoint_dir(family))).model
    stepped = random_pool(model, slots=3, capacity=40, seed=2, ssm_scale=0.3)
    assert_verification_and_keep_equal_module_steps(model, stepped, accepted, [5, 0, 30])


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(checkpoint_dir, family):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, every slot holds the states and KV entries of a fresh
    prefill of its kept tokens, and the output is plain greedy decoding's."""
    assert_forced_acceptance_keeps_prefill_states(checkpoint_dir(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_through_plans_equals_the_module_path(checkpoint_dir, family):
    path = checkpoint_dir(family)
    expected, _ = generate(path, decode_plan=False)
    plain, runner = generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    assert_speculation_equals(path, NGRAM, expected)


@pytest.mark.parametrize(
    ("family", "draft"),
    [("lfm3", "draft_attention"), ("olmo_hybrid", "draft_hybrid"), ("lfm2_moe", "lfm2"), ("olmo_hybrid_rope", "lfm3")],
)
def test_draft_model_speculation_through_plans_equals_plain(checkpoint_dir, monkeypatch, family, draft):
    """An attention-only draft, a Mamba2 hybrid draft, and LFM drafts (short convs shifted on the draft's side too):
    the target's and the draft's steps run through plans; greedy output is plain greedy's."""
    path = checkpoint_dir(family)
    draft_path = checkpoint_dir(draft) if draft in FAMILIES else checkpoint_dir(draft)
    expected, _ = generate(path, decode_plan=False)
    plans: list[DecodePlan] = []
    monkeypatch.setattr(DecodePlan, "__init__", recording(DecodePlan.__init__, plans))
    got, runner = generate(path, speculative=SpeculativeConfig("draft", 3, draft_model=str(draft_path), policy="fixed"))
    assert got == expected and runner.spec_stats()["num_draft_tokens"] > 0
    assert isinstance(runner._scheduler.workspace.plan, DecodePlan)
    draft_type = load_checkpoint(str(draft_path)).config.model_type
    assert {plan.model.config.model_type for plan in plans} == {runner.config.model_type, draft_type}
