"""Decode plans of Kimi-Linear (Kimi Delta Attention, multi-head latent attention, MoE or dense MLPs) against the
module-by-module native path, bit for bit: plain steps with changing batch sizes and reused slots, verification +
keep under accepted patterns, forced acceptance through the scheduler (every state and latent cache entry equal to
a fresh prefill of the kept tokens), greedy generation plain and speculative (n-gram, draft models)."""

from __future__ import annotations

import pytest
import torch

from tests.kimi_models import build_kimi_checkpoint
from tests.tiny_models import engine_config
from tests.workers.model.test_decode_plan import _clone, _random_pool
from tests.workers.model.test_decode_plan_gdn import _module_step
from tests.workers.spec_decode.test_state_shifting import (
    PARAMS,
    ScriptedProposer,
    _assert_slot_matches,
    _prompts,
    _requests,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason
from workers.scheduler import Scheduler

FAMILIES = ["kimi_linear", "kimi_linear_qlora", "kimi_linear_dense", "kimi_linear_odd", "kimi_linear_wide"]
PROMPTS = [[5, 9, 30, 5, 9, 30, 5, 9], [8, 8, 8, 8], [100, 3, 17, 100, 3, 17, 100], [7]]  # 4 prompts, 3 slots
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_kimi_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def _generate(path: str, **options) -> tuple[list[list[int]], ModelRunner]:
    runner = ModelRunner.from_pretrained(path, max_num_seqs=3, **options)
    return [r.token_ids for r in runner.generate(PROMPTS, GREEDY)], runner


def test_kimi_models_are_covered_and_the_others_say_why(kimi_dir):
    for family in FAMILIES:
        assert unsupported_reason(load_checkpoint(str(kimi_dir(family))).model) is None, family
    model = load_checkpoint(str(kimi_dir("kimi_linear"))).model
    next(b for b in model.blocks if b.kind == "kda").mixer.decode_kernel = "torch"
    assert unsupported_reason(model) == "Kimi Delta Attention decode steps do not run through the native kernel"
    model = load_checkpoint(str(kimi_dir("kimi_linear_qlora"))).model
    model.blocks[0].mixer.native = False
    assert unsupported_reason(model) == "latent attention decode steps do not run through the native kernel"
    torch_model = load_checkpoint(str(kimi_dir("kimi_linear_dense")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_steps_equal_the_module_path_bit_for_bit(kimi_dir, family):
    model = load_checkpoint(str(kimi_dir(family))).model
    reference = _random_pool(model, slots=4, capacity=40, seed=0)
    reference.ssm.mul_(0.3)  # delta-rule states of the size decoding leaves
    planned = _clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    # Batch sizes change between steps (requests finish, slots are reused); positions cross KV block boundaries.
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
@pytest.mark.parametrize("family", FAMILIES)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(kimi_dir, family, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows."""
    model = load_checkpoint(str(kimi_dir(family))).model
    stepped = _random_pool(model, slots=3, capacity=32, seed=2)
    stepped.ssm.mul_(0.3)
    verified = _clone(stepped)
    plan = DecodePlan(model, verified, tokens_per_row=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=g).tolist()  # [x_last, d_1, d_2, d_3]
    positions = [5, 0, 14]  # row 2's tokens cross a KV block boundary (16)
    steps, snapshots = [], [(stepped.conv.clone(), stepped.ssm.clone())]
    for t in range(4):  # the reference: four plain module steps, with every state along the way
        steps.append(_module_step(model, stepped, [row[t] for row in tokens], [p + t for p in positions]))
        snapshots.append((stepped.conv.clone(), stepped.ssm.clone()))
    logits = plan.verify(tokens, positions)
    for t, (step_logits, step_hidden) in enumerate(steps):
        assert torch.equal(logits[:, t], step_logits), f"logits of token {t}"
        assert torch.equal(plan.last_hidden()[:, t], step_hidden), f"final hidden states of token {t}"
    assert torch.equal(verified.key, stepped.key) and torch.equal(verified.value, stepped.value)
    assert torch.equal(verified.ssm, snapshots[0][1])  # left as it was until keep
    plan.keep(accepted)
    for row, n in enumerate(accepted):  # the state after input n − 1: the snapshot after n plain steps
        conv, ssm = snapshots[n]
        assert torch.equal(verified.conv[:, row], conv[:, row]), f"conv window of row {row}"
        assert torch.equal(verified.ssm[:, row], ssm[:, row]), f"delta-rule state of row {row}"


def test_a_latent_attention_step_at_a_position_without_a_block_is_refused(kimi_dir):
    model = load_checkpoint(str(kimi_dir("kimi_linear_qlora"))).model  # latent attention is its first layer
    pool = _random_pool(model, slots=2, capacity=32, seed=4)
    pool.blocks.tables[1, 1] = 0  # slot 1 has no block for positions 16 … 31
    before = _clone(pool)
    plan = DecodePlan(model, pool)
    with pytest.raises(ValueError, match="without a KV block"):
        plan.run([5, 6], [3, 20])
    assert torch.equal(pool.key, before.key) and torch.equal(pool.ssm, before.ssm)  # refused before any write


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_through_plans_equals_the_module_path(kimi_dir, family):
    path = str(kimi_dir(family))
    expected, _ = _generate(path, decode_plan=False)
    plain, runner = _generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")
    spec = ModelRunner.from_pretrained(path, max_num_seqs=3, speculative=ngram)
    for _ in range(2):  # the second call reuses the first one's slots and plan
        assert [r.token_ids for r in spec.generate(PROMPTS, GREEDY)] == expected
    assert isinstance(spec._scheduler.workspace.plan, DecodePlan) and spec._scheduler.workspace.plan.tokens_per_row == 4
    assert spec.spec_stats()["num_draft_tokens"] > 0
    # The module path verifies natively too (KDA's verify and keep kernels, latent attention's kernel).
    module_spec = ModelRunner.from_pretrained(path, max_num_seqs=3, speculative=ngram, decode_plan=False)
    assert [r.token_ids for r in module_spec.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("draft", ["kimi_linear_dense", "draft_hybrid"])
def test_draft_models_step_through_their_own_plans(kimi_dir, checkpoint_dir, draft, monkeypatch):
    """Draft-model speculation for a Kimi-Linear target: a Kimi-Linear draft (KDA and latent attention planned on
    both sides) and a Mamba2 hybrid draft; greedy output equals plain greedy output."""
    path = str(kimi_dir("kimi_linear"))
    draft_path = str(kimi_dir(draft) if draft.startswith("kimi") else checkpoint_dir(draft))
    expected, _ = _generate(path, decode_plan=False)
    plans: list[DecodePlan] = []
    init = DecodePlan.__init__

    def record(plan: DecodePlan, *args, **kwargs) -> None:
        init(plan, *args, **kwargs)
        plans.append(plan)

    monkeypatch.setattr(DecodePlan, "__init__", record)
    got, runner = _generate(path, speculative=SpeculativeConfig("draft", 3, draft_model=draft_path, policy="fixed"))
    assert got == expected and runner.spec_stats()["num_draft_tokens"] > 0
    assert "kimi_linear" in {plan.model.config.model_type for plan in plans}
    if draft.startswith("kimi"):
        assert len({id(plan.model) for plan in plans}) == 2  # the draft runs its own plan


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_linear_odd", "kimi_linear_wide"])
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(kimi_dir, family):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, every slot holds the states and latent cache of a fresh
    prefill of its tokens, and the output is plain greedy decoding's."""
    runner = ModelRunner.from_pretrained(str(kimi_dir(family)), max_num_seqs=4, decode_plan=False)
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
