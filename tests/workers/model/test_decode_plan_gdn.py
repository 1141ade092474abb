"""Decode plans of the dense Gated DeltaNet hybrids — Qwen3.5 text-only (`qwen3_5_text`) and vision-language
(`qwen3_5`) layouts, Qwen3-Next without experts — against the module-by-module native path, bit for bit: GDN
blocks, gated attention with per-head q/k norms and partial RoPE, zero-centred norms; verification + keep under
forced acceptance patterns; greedy generation plain, with n-gram and with MTP speculation."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import engine_config
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
from tests.workers.spec_decode.test_mtp import ForcedMtp, run_checking_mtp_kv
from tests.workers.spec_decode.test_state_shifting import PARAMS, _prompts, _requests
from workers import ModelRunner, SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason
from workers.scheduler import Scheduler
from workers.spec_decode.mtp import MtpProposer

GDN_PLANNED = ["qwen3_5_text", "qwen3_5", "qwen3_next_dense", "qwen3_5_wide"]


def test_gdn_models_are_covered_and_the_others_say_why(checkpoint_dir):
    for family in GDN_PLANNED:
        model = load_checkpoint(str(checkpoint_dir(family))).model
        config = model.config
        assert config.zero_centred_norms and config.attention.output_gate and config.attention.qk_norm
        assert config.gdn.num_value_heads == 2 * config.gdn.num_key_heads  # value heads share key heads
        assert 0 < config.attention.rotary_dim < config.attention.head_dim  # partial RoPE
        assert unsupported_reason(model) is None, family
    for family in ("qwen3_next", "qwen3_5_moe"):  # their MoE blocks too (tests/workers/model/test_moe.py)
        assert unsupported_reason(load_checkpoint(str(checkpoint_dir(family))).model) is None, family
    model = load_checkpoint(str(checkpoint_dir("qwen3_5_text"))).model
    model.blocks[0].mixer.decode_kernel = "triton"
    assert unsupported_reason(model) == "Gated DeltaNet decode steps do not run through the native kernel"
    torch_model = load_checkpoint(str(checkpoint_dir("qwen3_5")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)


@pytest.mark.parametrize("family", GDN_PLANNED)
def test_plan_steps_equal_the_module_path_bit_for_bit(checkpoint_dir, family):
    model = load_checkpoint(str(checkpoint_dir(family))).model
    reference = random_pool(model, slots=4, capacity=40, seed=0, ssm_scale=0.3)
    # Batch sizes change between steps (requests finish); positions past 16 cross partial RoPE's slow dimensions.
    assert_plan_steps_equal_module_steps(model, reference, [3, 3, 4, 2, 1, 4, 4], 40, lambda step: min(step + 33, 39))


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("family", GDN_PLANNED)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(checkpoint_dir, family, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows."""
    model = load_checkpoint(str(checkpoint_dir(family))).model
    stepped = random_pool(model, slots=3, capacity=16, seed=2)
    plan, steps = assert_verification_and_keep_equal_module_steps(model, stepped, accepted, [5, 0, 11])
    assert torch.equal(plan.last_hidden()[:, 3], steps[3][1])  # keep leaves the hidden states for an observer


@pytest.mark.parametrize("family", GDN_PLANNED)
def test_greedy_generation_through_plans_equals_the_module_path(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    expected, _ = generate(path, decode_plan=False)
    plain, runner = generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    assert_speculation_equals(path, NGRAM, expected)  # random weights rarely repeat: mostly rejected drafts


def test_a_gdn_draft_model_steps_through_its_own_plan(checkpoint_dir, monkeypatch):
    """Draft-model speculation with Gated DeltaNet models on both sides: target and draft steps both planned."""
    path, draft = str(checkpoint_dir("qwen3_5_text")), str(checkpoint_dir("qwen3_5"))
    expected, _ = generate(path, decode_plan=False)
    plans: list[DecodePlan] = []
    monkeypatch.setattr(DecodePlan, "__init__", recording(DecodePlan.__init__, plans))
    got, runner = generate(path, speculative=SpeculativeConfig("draft", 3, draft_model=draft, policy="fixed"))
    assert got == expected and runner.spec_stats()["num_draft_tokens"] > 0
    assert {plan.model.config.model_type for plan in plans} == {"qwen3_5_text", "qwen3_5"}


@pytest.mark.parametrize("family", GDN_PLANNED)
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(checkpoint_dir, family):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, every slot holds the state of its tokens, and the output
    is plain greedy decoding's."""
    assert_forced_acceptance_keeps_prefill_states(checkpoint_dir(family))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next_dense"])
def test_mtp_drafts_from_the_plans_hidden_states(checkpoint_dir, family):
    """The MTP proposer reads the target's hidden states from the plan: its KV cache holds exactly the accepted
    positions' entries under forced acceptance patterns (0 drafts, none, all, partial), and greedy MTP through
    the plan equals plain greedy decoding."""
    path = str(checkpoint_dir(family))
    runner = ModelRunner.from_pretrained(path, max_num_seqs=4, speculative=SpeculativeConfig("mtp", 4))
    prompts = _prompts()
    reference = {
        i: r.token_ids
        for i, r in enumerate(
            ModelRunner.from_pretrained(path, max_num_seqs=4, decode_plan=False).generate(prompts, PARAMS)
        )
    }
    mtp = MtpProposer(runner.model, 4)
    proposer = ForcedMtp(mtp, reference, runner.config.vocab_size)
    scheduler = Scheduler(runner.model, engine_config(4, 4, decode_plan=True), _requests(prompts), proposer)
    assert isinstance(scheduler.plan, DecodePlan)
    assert run_checking_mtp_kv(scheduler, mtp) > 20
    assert all(accepted == expected for accepted, expected in proposer.seen)
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference
    got, mtp_runner = generate(path, speculative=SpeculativeConfig("mtp", 3, policy="fixed"))
    assert got == generate(path, decode_plan=False)[0]
    assert isinstance(mtp_runner._scheduler.workspace.plan, DecodePlan) and mtp_runner.spec_stats()["num_drafts"] > 0
