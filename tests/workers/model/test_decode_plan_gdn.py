"""Decode plans of the dense Gated DeltaNet hybrids — Qwen3.5 text-only (`qwen3_5_text`) and vision-language
(`qwen3_5`) layouts, Qwen3-Next without experts — against the module-by-module native path, bit for bit: GDN
blocks, gated attention with per-head q/k norms and partial RoPE, zero-centred norms; verification + keep under
forced acceptance patterns; greedy generation plain, with n-gram and with MTP speculation."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import engine_config
from tests.workers.model.test_decode_plan import _clone, _random_pool
from tests.workers.spec_decode.test_mtp import ForcedMtp, run_checking_mtp_kv
from tests.workers.spec_decode.test_state_shifting import (
    PARAMS,
    ScriptedProposer,
    _assert_slot_matches,
    _prompts,
    _requests,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import ForwardBatch, StatePool, load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason
from workers.scheduler import Scheduler
from workers.spec_decode.mtp import MtpProposer

GDN_PLANNED = ["qwen3_5_text", "qwen3_5", "qwen3_next_dense", "qwen3_5_wide"]
PROMPTS = [[5, 9, 30, 5, 9, 30, 5, 9], [8, 8, 8, 8], [100, 3, 17, 100, 3, 17, 100], [7]]  # 4 prompts, 3 slots
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def _module_step(model, pool: StatePool, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, ...]:
    """One in-place decode step of rows 0 … b-1 on the module path → (logits [b, v], final hidden [b, d])."""
    b = len(token_ids)
    slots, cache_lens = torch.arange(b), torch.tensor(positions)
    batch = ForwardBatch(slots, cache_lens, torch.ones_like(cache_lens), slots_are_prefix=True, one_token_each=True)
    with torch.inference_mode():
        out = model(torch.tensor(token_ids)[:, None], batch, pool.prefix(b), pool.kv_caches(), in_place=True)
        return model.logits(out.hidden[:, 0]), out.hidden[:, 0]


def _generate(path: str, **options) -> tuple[list[list[int]], ModelRunner]:
    runner = ModelRunner.from_pretrained(path, max_num_seqs=3, **options)
    return [r.token_ids for r in runner.generate(PROMPTS, GREEDY)], runner


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
    reference = _random_pool(model, slots=4, capacity=40, seed=0)
    reference.ssm.mul_(0.3)  # delta-rule states of the size decoding leaves
    planned = _clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    # Batch sizes change between steps (requests finish); positions past 16 cross partial RoPE's slow dimensions.
    for step, b in enumerate([3, 3, 4, 2, 1, 4, 4]):
        token_ids = torch.randint(0, model.config.vocab_size, (b,), generator=g).tolist()
        positions = torch.randint(0, 40, (b,), generator=g).tolist()
        positions[0] = min(step + 33, 39)
        expected, hidden = _module_step(model, reference, token_ids, positions)
        assert torch.equal(plan.run(token_ids, positions), expected), f"logits of step {step}"
        assert torch.equal(plan.last_hidden()[:, 0], hidden), f"final hidden states of step {step}"
        for name in ("conv", "ssm", "key", "value"):
            assert torch.equal(getattr(planned, name), getattr(reference, name)), f"{name} after step {step}"


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("family", GDN_PLANNED)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(checkpoint_dir, family, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows."""
    model = load_checkpoint(str(checkpoint_dir(family))).model
    stepped = _random_pool(model, slots=3, capacity=16, seed=2)
    verified = _clone(stepped)
    plan = DecodePlan(model, verified, tokens_per_row=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=g).tolist()  # [x_last, d_1, d_2, d_3]
    positions = [5, 0, 11]
    # The reference: four plain module steps, with every state along the way.
    steps, snapshots = [], [(stepped.conv.clone(), stepped.ssm.clone())]
    for t in range(4):
        steps.append(_module_step(model, stepped, [row[t] for row in tokens], [p + t for p in positions]))
        snapshots.append((stepped.conv.clone(), stepped.ssm.clone()))
    logits = plan.verify(tokens, positions)
    for t, (step_logits, step_hidden) in enumerate(steps):
        assert torch.equal(logits[:, t], step_logits), f"logits of token {t}"
        assert torch.equal(plan.last_hidden()[:, t], step_hidden), f"final hidden states of token {t}"
    assert torch.equal(verified.key, stepped.key) and torch.equal(verified.value, stepped.value)
    plan.keep(accepted)
    for row, n in enumerate(accepted):  # the state after input n − 1: the snapshot after n plain steps
        conv, ssm = snapshots[n]
        assert torch.equal(verified.conv[:, row], conv[:, row]), f"conv window of row {row}"
        assert torch.equal(verified.ssm[:, row], ssm[:, row]), f"delta-rule state of row {row}"
    assert torch.equal(plan.last_hidden()[:, 3], steps[3][1])  # keep leaves the hidden states for an observer


@pytest.mark.parametrize("family", GDN_PLANNED)
def test_greedy_generation_through_plans_equals_the_module_path(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    expected, _ = _generate(path, decode_plan=False)
    plain, runner = _generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")
    spec = ModelRunner.from_pretrained(path, max_num_seqs=3, speculative=ngram)
    for _ in range(2):  # the second call reuses the first one's slots and plan
        assert [r.token_ids for r in spec.generate(PROMPTS, GREEDY)] == expected
    assert isinstance(spec._scheduler.workspace.plan, DecodePlan) and spec._scheduler.workspace.plan.tokens_per_row == 4
    assert spec.spec_stats()["num_draft_tokens"] > 0  # random weights rarely repeat: mostly rejected drafts


def test_a_gdn_draft_model_steps_through_its_own_plan(checkpoint_dir, monkeypatch):
    """Draft-model speculation with Gated DeltaNet models on both sides: target and draft steps both planned."""
    path, draft = str(checkpoint_dir("qwen3_5_text")), str(checkpoint_dir("qwen3_5"))
    expected, _ = _generate(path, decode_plan=False)
    plans: list[DecodePlan] = []
    monkeypatch.setattr(DecodePlan, "__init__", _recording(DecodePlan.__init__, plans))
    got, runner = _generate(path, speculative=SpeculativeConfig("draft", 3, draft_model=draft, policy="fixed"))
    assert got == expected and runner.spec_stats()["num_draft_tokens"] > 0
    assert {plan.model.config.model_type for plan in plans} == {"qwen3_5_text", "qwen3_5"}


def _recording(init, plans: list[DecodePlan]):
    def record(plan: DecodePlan, *args, **kwargs) -> None:
        init(plan, *args, **kwargs)
        plans.append(plan)

    return record


@pytest.mark.parametrize("family", GDN_PLANNED)
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(checkpoint_dir, family):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, every slot holds the state of its tokens, and the output
    is plain greedy decoding's."""
    runner = ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=4, decode_plan=False)
    prompts = _prompts()
    reference = {i: r.token_ids for i, r in enumerate(runner.generate(prompts, PARAMS))}
    proposer = ScriptedProposer(reference, runner.config.vocab_size)
    scheduler = Scheduler(runner.model, engine_config(4, 4, decode_plan=True), _requests(prompts), proposer)
    assert isinstance(scheduler.plan, DecodePlan)
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:  # the slot covers every token but the newest (vs one prefill: TOL)
            _assert_slot_matches(scheduler.pool, request.slot, runner.model, (request.prompt + request.output)[:-1])
    assert all(accepted == expected for accepted, expected in proposer.seen)
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference


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
    got, mtp_runner = _generate(path, speculative=SpeculativeConfig("mtp", 3, policy="fixed"))
    assert got == _generate(path, decode_plan=False)[0]
    assert isinstance(mtp_runner._scheduler.workspace.plan, DecodePlan) and mtp_runner.spec_stats()["num_drafts"] > 0
