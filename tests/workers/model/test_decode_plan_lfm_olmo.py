"""Decode plans of LFM2 / LFM2-MoE / LFM3 (short convs, per-head q/k norms, LFM3's sandwich norms, per-head output
gates, sliding-window layers, proportional RoPE) and OLMo-Hybrid (post-norm attention blocks, whole-width q/k norms,
beta = 2·sigmoid(b) Gated DeltaNets; NoPE and RoPE) against the module-by-module native path, bit for bit: decode
steps with changing batch sizes and positions past the sliding window, verification + keep under forced acceptance
patterns, greedy generation plain and speculative (n-gram, attention draft, hybrid draft)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lfm_models import lfm_checkpoint  # noqa: F401 (a fixture)
from tests.tiny_models import engine_config
from tests.workers.model.olmo_hybrid_fixtures import build_olmo_hybrid
from tests.workers.model.test_decode_plan import _clone, _random_pool
from tests.workers.model.test_decode_plan_gdn import _module_step, _recording
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

LFM = ["lfm2", "lfm2_untied", "lfm2_moe", "lfm3"]
OLMO = ["olmo_hybrid", "olmo_hybrid_rope"]
FAMILIES = LFM + OLMO
PROMPTS = [[5, 9, 30, 5, 9, 30, 5, 9], [8, 8, 8, 8], [100, 3, 17, 100, 3, 17, 100], [7]]  # 4 prompts, 3 slots
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def family_dir(lfm_checkpoint, tmp_path_factory):  # noqa: F811
    """family → its tiny checkpoint directory (the LFM ones from tests/lfm_models.py, OLMo's built here once)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family in LFM:
            return lfm_checkpoint(family)
        if family not in built:
            built[family] = build_olmo_hybrid(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def _generate(path: Path, **options) -> tuple[list[list[int]], ModelRunner]:
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=3, **options)
    return [r.token_ids for r in runner.generate(PROMPTS, GREEDY)], runner


def test_the_families_are_covered_and_the_torch_kernels_say_why(family_dir):
    for family in FAMILIES:
        model = load_checkpoint(str(family_dir(family))).model
        assert unsupported_reason(model) is None, family
    lfm3 = load_checkpoint(str(family_dir("lfm3"))).model
    windows = {block.mixer.config.sliding_window for block in lfm3.blocks if block.kind == "attention"}
    assert windows == {None, 8} and lfm3.config.sandwich_norms  # the layouts these tests rely on
    olmo = load_checkpoint(str(family_dir("olmo_hybrid"))).model
    assert olmo.config.gdn.beta_scale == 2.0 and olmo.config.post_norm_blocks
    assert all(m.decode_kernel == "native" for m in olmo.modules() if hasattr(m, "decode_kernel"))
    lfm3.blocks[0].mixer.decode_kernel = "torch"
    assert unsupported_reason(lfm3) == "short-conv decode steps do not run through the native kernel"
    torch_model = load_checkpoint(str(family_dir("olmo_hybrid")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_steps_equal_the_module_path_bit_for_bit(family_dir, family):
    model = load_checkpoint(str(family_dir(family))).model
    reference = _random_pool(model, slots=4, capacity=40, seed=0)
    reference.ssm.mul_(0.3)  # delta-rule states of the size decoding leaves (LFM: empty)
    planned = _clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    # Batch sizes change between steps; positions run from inside LFM3's window of 8 to far past it.
    for step, b in enumerate([3, 3, 4, 2, 1, 4, 4]):
        token_ids = torch.randint(0, model.config.vocab_size, (b,), generator=g).tolist()
        positions = torch.randint(0, 40, (b,), generator=g).tolist()
        positions[0] = min(step * 6 + 2, 39)
        expected, hidden = _module_step(model, reference, token_ids, positions)
        assert torch.equal(plan.run(token_ids, positions), expected), f"logits of step {step}"
        assert torch.equal(plan.last_hidden()[:, 0], hidden), f"final hidden states of step {step}"
        for name in ("conv", "ssm", "key", "value"):
            assert torch.equal(getattr(planned, name), getattr(reference, name)), f"{name} after step {step}"


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(family_dir, family, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows; one
    row's tokens cross LFM3's sliding window."""
    model = load_checkpoint(str(family_dir(family))).model
    stepped = _random_pool(model, slots=3, capacity=40, seed=2)
    stepped.ssm.mul_(0.3)
    verified = _clone(stepped)
    plan = DecodePlan(model, verified, tokens_per_row=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=g).tolist()  # [x_last, d_1, d_2, d_3]
    positions = [5, 0, 30]
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
        assert torch.equal(verified.ssm[:, row], ssm[:, row]), f"recurrent state of row {row}"


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(family_dir, family):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, every slot holds the states and KV entries of a fresh
    prefill of its kept tokens, and the output is plain greedy decoding's."""
    runner = ModelRunner.from_pretrained(str(family_dir(family)), max_num_seqs=4, decode_plan=False)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_through_plans_equals_the_module_path(family_dir, family):
    path = family_dir(family)
    expected, _ = _generate(path, decode_plan=False)
    plain, runner = _generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")
    spec = ModelRunner.from_pretrained(str(path), max_num_seqs=3, speculative=ngram)
    for _ in range(2):  # the second call reuses the first one's slots and plan
        assert [r.token_ids for r in spec.generate(PROMPTS, GREEDY)] == expected
    plan = spec._scheduler.workspace.plan
    assert isinstance(plan, DecodePlan) and plan.tokens_per_row == 4
    assert spec.spec_stats()["num_draft_tokens"] > 0


@pytest.mark.parametrize(
    ("family", "draft"),
    [("lfm3", "draft_attention"), ("olmo_hybrid", "draft_hybrid"), ("lfm2_moe", "lfm2"), ("olmo_hybrid_rope", "lfm3")],
)
def test_draft_model_speculation_through_plans_equals_plain(family_dir, checkpoint_dir, monkeypatch, family, draft):
    """An attention-only draft, a Mamba2 hybrid draft, and LFM drafts (short convs shifted on the draft's side too):
    the target's and the draft's steps run through plans; greedy output is plain greedy's."""
    path = family_dir(family)
    draft_path = family_dir(draft) if draft in FAMILIES else checkpoint_dir(draft)
    expected, _ = _generate(path, decode_plan=False)
    plans: list[DecodePlan] = []
    monkeypatch.setattr(DecodePlan, "__init__", _recording(DecodePlan.__init__, plans))
    got, runner = _generate(
        path, speculative=SpeculativeConfig("draft", 3, draft_model=str(draft_path), policy="fixed")
    )
    assert got == expected and runner.spec_stats()["num_draft_tokens"] > 0
    assert isinstance(runner._scheduler.workspace.plan, DecodePlan)
    draft_type = load_checkpoint(str(draft_path)).config.model_type
    assert {plan.model.config.model_type for plan in plans} == {runner.config.model_type, draft_type}
