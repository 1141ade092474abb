"""Decode plans of Jamba (Mamba1 + attention + MoE / MLP) against the module-by-module native path, bit for bit:
steps with changing batch sizes and reused slots, verification + keep under forced acceptance patterns, greedy
speculation (n-gram, a Mamba1 draft, a Mamba2 hybrid draft) equal to plain greedy with the plan on. Layouts: the two
of tests/tiny_jamba.py and an odd one (d_inner 35, state size 5, dt rank 3, a 2-tap conv)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import JambaConfig, JambaForCausalLM

from tests.tiny_jamba import _COMMON, build_jamba_checkpoint, randomise_jamba
from tests.tiny_models import BOS, EOS, engine_config, make_tokenizer
from tests.workers.model.test_decode_plan import _clone, _module_step, _random_pool
from tests.workers.spec_decode.test_state_shifting import (
    PARAMS,
    ScriptedProposer,
    _assert_slot_matches,
    _prompts,
    _requests,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason
from workers.scheduler import Scheduler

LAYOUTS = ["jamba_moe", "jamba_dense", "jamba_odd"]
PROMPTS = [[5, 9, 30, 5, 9, 30, 5, 9], [8, 8, 8, 8], [100, 3, 17, 100, 3, 17, 100], [7]]  # 4 prompts, 3 slots
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
ODD = dict(hidden_size=35, num_attention_heads=5, num_key_value_heads=1, mamba_expand=1, mamba_d_state=5,
           mamba_dt_rank=3, mamba_d_conv=2, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1,
           expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1)  # fmt: skip


def _build_odd(directory):
    torch.manual_seed(0)
    model = JambaForCausalLM(JambaConfig(**{**_COMMON, **ODD}))
    randomise_jamba(model, 0)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """layout → its checkpoint directory, built once per module ("+near": a perturbed copy, a partial drafter)."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            directory = tmp_path_factory.mktemp(name.replace("+", "_"))
            layout, _, flavour = name.partition("+")
            if layout == "jamba_odd":
                built[name] = _build_odd(directory)
            else:
                built[name] = build_jamba_checkpoint(layout, directory, perturb=0.003 if flavour else 0.0)
        return str(built[name])

    return get


def test_the_odd_layout_has_the_odd_shapes(paths):
    model = load_checkpoint(paths("jamba_odd")).model
    m = next(mod for mod in model.modules() if isinstance(mod, Mamba1Mixer)).config
    assert (m.intermediate_size, m.state_size, m.dt_rank, m.conv_kernel) == (35, 5, 3, 2)
    assert unsupported_reason(model) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_steps_equal_the_module_path_bit_for_bit(paths, layout):
    model = load_checkpoint(paths(layout)).model
    reference = _random_pool(model, slots=4, capacity=40, seed=0)
    reference.ssm.mul_(0.3)
    planned = _clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    for step, b in enumerate([3, 3, 4, 2, 1, 4, 4]):  # batch sizes change (requests finish, slots are reused)
        token_ids = torch.randint(0, model.config.vocab_size, (b,), generator=g).tolist()
        positions = torch.randint(0, 40, (b,), generator=g).tolist()
        expected = _module_step(model, reference, token_ids, positions)
        assert torch.equal(plan.run(token_ids, positions), expected), f"logits of step {step}"
        for name in ("conv", "ssm", "key", "value"):
            assert torch.equal(getattr(planned, name), getattr(reference, name)), f"{name} after step {step}"


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(paths, layout, accepted):
    model = load_checkpoint(paths(layout)).model
    stepped = _random_pool(model, slots=3, capacity=16, seed=2)
    stepped.ssm.mul_(0.3)
    verified = _clone(stepped)
    plan = DecodePlan(model, verified, tokens_per_row=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=g).tolist()  # [x_last, d_1, d_2, d_3]
    positions = [5, 0, 11]
    steps, snapshots = [], [(stepped.conv.clone(), stepped.ssm.clone())]
    for t in range(4):
        steps.append(_module_step(model, stepped, [row[t] for row in tokens], [p + t for p in positions]))
        snapshots.append((stepped.conv.clone(), stepped.ssm.clone()))
    logits = plan.verify(tokens, positions)
    for t, step_logits in enumerate(steps):
        assert torch.equal(logits[:, t], step_logits), f"logits of token {t}"
    assert torch.equal(verified.key, stepped.key) and torch.equal(verified.value, stepped.value)
    assert torch.equal(verified.conv, snapshots[0][0]) and torch.equal(verified.ssm, snapshots[0][1])
    plan.keep(accepted)
    for row, n in enumerate(accepted):  # the state after input n − 1: the snapshot after n plain steps
        assert torch.equal(verified.conv[:, row], snapshots[n][0][:, row]), f"conv window of row {row}"
        assert torch.equal(verified.ssm[:, row], snapshots[n][1][:, row]), f"SSM state of row {row}"


def test_sixteen_rows_keep_each_their_own_count(paths):
    """16 rows of 5 tokens, every count 1 … 5 among them, against 5 plain plan steps (the MoE layout)."""
    model = load_checkpoint(paths("jamba_moe")).model
    stepped = _random_pool(model, slots=16, capacity=24, seed=4)
    verified = _clone(stepped)
    step_plan, verify_plan = DecodePlan(model, stepped), DecodePlan(model, verified, tokens_per_row=5)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.config.vocab_size, (16, 5), generator=g).tolist()
    positions = torch.randint(0, 18, (16,), generator=g).tolist()
    snapshots, step_logits = [(stepped.conv.clone(), stepped.ssm.clone())], []
    for t in range(5):
        step_logits.append(step_plan.run([row[t] for row in tokens], [p + t for p in positions]).clone())
        snapshots.append((stepped.conv.clone(), stepped.ssm.clone()))
    logits = verify_plan.verify(tokens, positions)
    for t in range(5):
        assert torch.equal(logits[:, t], step_logits[t]), f"token {t}"
    accepted = [1 + i % 5 for i in range(16)]
    verify_plan.keep(accepted)
    for row, n in enumerate(accepted):
        assert torch.equal(verified.conv[:, row], snapshots[n][0][:, row]), f"conv window of row {row}"
        assert torch.equal(verified.ssm[:, row], snapshots[n][1][:, row]), f"SSM state of row {row}"


@pytest.mark.parametrize("layout", ["jamba_dense", "jamba_odd"])
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(paths, layout):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: every slot holds the states and KV of a fresh prefill of its kept tokens, and the output is plain
    greedy decoding's."""
    runner = ModelRunner.from_pretrained(paths(layout), max_num_seqs=4, decode_plan=False)
    prompts = _prompts()
    reference = {i: r.token_ids for i, r in enumerate(runner.generate(prompts, PARAMS))}
    proposer = ScriptedProposer(reference, runner.config.vocab_size)
    scheduler = Scheduler(runner.model, engine_config(4, 4, decode_plan=True), _requests(prompts), proposer)
    assert isinstance(scheduler.plan, DecodePlan)
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:  # the slot covers every token but the newest
            _assert_slot_matches(scheduler.pool, request.slot, runner.model, (request.prompt + request.output)[:-1])
    assert all(accepted == expected for accepted, expected in proposer.seen)
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference


@pytest.mark.parametrize(
    "method, draft", [("ngram", None), ("draft", "jamba_moe+near"), ("draft", "draft_hybrid")], ids=str
)
def test_greedy_speculation_through_plans_equals_plain_greedy(paths, checkpoint_dir, method, draft):
    path = paths("jamba_moe")
    expected = [
        r.token_ids
        for r in ModelRunner.from_pretrained(path, max_num_seqs=3, decode_plan=False).generate(PROMPTS, GREEDY)
    ]
    plain = ModelRunner.from_pretrained(path, max_num_seqs=3)
    assert [r.token_ids for r in plain.generate(PROMPTS, GREEDY)] == expected
    assert isinstance(plain._scheduler.workspace.plan, DecodePlan)
    draft_path = None if draft is None else paths(draft) if draft.startswith("jamba") else str(checkpoint_dir(draft))
    spec = SpeculativeConfig(
        method, 3, prompt_lookup_min=1, prompt_lookup_max=2, draft_model=draft_path, policy="fixed"
    )
    runner = ModelRunner.from_pretrained(path, max_num_seqs=3, speculative=spec)
    for _ in range(2):  # the second call reuses the first one's slots and plan
        assert [r.token_ids for r in runner.generate(PROMPTS, GREEDY)] == expected
    plan = runner._scheduler.workspace.plan
    assert isinstance(plan, DecodePlan) and plan.tokens_per_row == 4
    assert runner.spec_stats()["num_draft_tokens"] > 0
