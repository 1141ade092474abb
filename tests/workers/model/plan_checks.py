"""Checks the decode-plan tests of every family share: random slot pools, in-place module-path steps, plan steps
against module steps, verification + keep against plain steps, forced acceptance patterns through a scheduler, and
greedy speculation through plans against plain greedy decoding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.tiny_models import engine_config
from tests.workers.spec_decode.test_state_shifting import (
    PARAMS,
    ScriptedProposer,
    _assert_slot_matches,
    _prompts,
    _requests,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import ForwardBatch, StatePool
from workers.model.steps.decode_plan import DecodePlan
from workers.scheduler import Scheduler

PROMPTS = [[5, 9, 30, 5, 9, 30, 5, 9], [8, 8, 8, 8], [100, 3, 17, 100, 3, 17, 100], [7]]  # 4 prompts, 3 slots
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
BUFFERS = ("conv", "ssm", "key", "value")
NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")


def random_pool(model, slots: int, capacity: int, seed: int, ssm_scale: float | None = None) -> StatePool:
    """A float32 slot pool filled with standard normal values; `ssm_scale` shrinks the recurrent states (delta-rule
    and SSM states of the size decoding leaves)."""
    pool = StatePool(model.config, slots, capacity, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    for name in BUFFERS:
        buffer = getattr(pool, name)
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    if ssm_scale is not None:
        pool.ssm.mul_(ssm_scale)
    return pool


def clone(pool: StatePool) -> StatePool:
    """A pool with copies of every buffer of `pool`."""
    copy = StatePool.__new__(StatePool)
    copy.__dict__.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in pool.__dict__.items()})
    return copy


def module_step(model, pool: StatePool, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, ...]:
    """One in-place decode step of rows 0 … b-1 on the module path → (logits [b, v], final hidden [b, d])."""
    b = len(token_ids)
    slots, cache_lens = torch.arange(b), torch.tensor(positions)
    batch = ForwardBatch(slots, cache_lens, torch.ones_like(cache_lens), slots_are_prefix=True, one_token_each=True)
    with torch.inference_mode():
        out = model(torch.tensor(token_ids)[:, None], batch, pool.prefix(b), pool.kv_caches(), in_place=True)
        return model.logits(out.hidden[:, 0]), out.hidden[:, 0]


def generate(path: str | Path, **options) -> tuple[list[list[int]], ModelRunner]:
    """Greedy outputs of PROMPTS through a 3-slot runner built with `options`, and the runner."""
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=3, **options)
    return [r.token_ids for r in runner.generate(PROMPTS, GREEDY)], runner


def recording(init, plans: list[DecodePlan]):
    """DecodePlan.__init__ wrapped to append every plan it builds to `plans` (for monkeypatch)."""

    def record(plan: DecodePlan, *args, **kwargs) -> None:
        init(plan, *args, **kwargs)
        plans.append(plan)

    return record


def assert_plan_steps_equal_module_steps(
    model,
    reference: StatePool,
    batch_sizes: list[int],
    max_position: int,
    first_position: Callable[[int], int] | None = None,
    hidden: bool = True,
) -> tuple[DecodePlan, StatePool]:
    """Plan steps over a copy of `reference` equal in-place module steps on it bit for bit — logits, every buffer
    and (with `hidden`) the final hidden states — with batch sizes changing between steps and random positions in
    [0, max_position), row 0's at `first_position(step)` when given. Returns the plan and its pool."""
    planned = clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    for step, b in enumerate(batch_sizes):
        token_ids = torch.randint(0, model.config.vocab_size, (b,), generator=g).tolist()
        positions = torch.randint(0, max_position, (b,), generator=g).tolist()
        if first_position is not None:
            positions[0] = first_position(step)
        expected, expected_hidden = module_step(model, reference, token_ids, positions)
        assert torch.equal(plan.run(token_ids, positions), expected), f"logits of step {step}"
        if hidden:
            assert torch.equal(plan.last_hidden()[:, 0], expected_hidden), f"final hidden states of step {step}"
        for name in BUFFERS:
            assert torch.equal(getattr(planned, name), getattr(reference, name)), f"{name} after step {step}"
    return plan, planned


def assert_kept(pool: StatePool, snapshots: list[tuple[torch.Tensor, torch.Tensor]], accepted: list[int]) -> None:
    """Row r of `pool` holds the state after input accepted[r] − 1: the snapshot after accepted[r] plain steps."""
    for row, n in enumerate(accepted):
        assert torch.equal(pool.conv[:, row], snapshots[n][0][:, row]), f"conv window of row {row}"
        assert torch.equal(pool.ssm[:, row], snapshots[n][1][:, row]), f"recurrent state of row {row}"


def assert_verification_and_keep_equal_module_steps(
    model, stepped: StatePool, accepted: list[int], positions: list[int], hidden: bool = True
) -> tuple[DecodePlan, list[tuple[torch.Tensor, ...]]]:
    """Verification of [x_last, d_1, d_2, d_3] per row through a plan over a copy of `stepped` gives the logits,
    (with `hidden`) final hidden states and KV entries of four in-place module steps on `stepped`, leaves the
    recurrent states as they were, and keep(accepted) gives each row the state of its own number of steps.
    Returns the plan and the module steps' (logits, hidden)."""
    verified = clone(stepped)
    plan = DecodePlan(model, verified, tokens_per_row=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (len(positions), 4), generator=g).tolist()
    steps, snapshots = [], [(stepped.conv.clone(), stepped.ssm.clone())]
    for t in range(4):
        steps.append(module_step(model, stepped, [row[t] for row in tokens], [p + t for p in positions]))
        snapshots.append((stepped.conv.clone(), stepped.ssm.clone()))
    logits = plan.verify(tokens, positions)
    for t, (step_logits, step_hidden) in enumerate(steps):
        assert torch.equal(logits[:, t], step_logits), f"logits of token {t}"
        if hidden:
            assert torch.equal(plan.last_hidden()[:, t], step_hidden), f"final hidden states of token {t}"
    assert torch.equal(verified.key, stepped.key) and torch.equal(verified.value, stepped.value)
    assert torch.equal(verified.conv, snapshots[0][0]) and torch.equal(verified.ssm, snapshots[0][1])
    plan.keep(accepted)
    assert_kept(verified, snapshots, accepted)
    return plan, steps


def assert_verification_and_keep_equal_plan_steps(
    step_plan: DecodePlan, verify_plan: DecodePlan, tokens: list[list[int]], positions: list[int], accepted: list[int]
) -> None:
    """Verification of `tokens` (one row each) through `verify_plan` gives the logits and KV entries of as many plain
    steps through `step_plan`, whose pool starts equal to verify_plan's, and leaves the recurrent states as they were;
    keep(accepted) then gives each row the state of its own number of plain steps."""
    stepped, verified = step_plan.pool, verify_plan.pool
    snapshots, step_logits = [(stepped.conv.clone(), stepped.ssm.clone())], []
    for t in range(len(tokens[0])):
        step_logits.append(step_plan.run([row[t] for row in tokens], [p + t for p in positions]).clone())
        snapshots.append((stepped.conv.clone(), stepped.ssm.clone()))
    logits = verify_plan.verify(tokens, positions)
    for t, expected in enumerate(step_logits):  # attention over KV blocks of 16: rows may cross block boundaries
        assert torch.equal(logits[:, t], expected), f"token {t}"
    assert torch.equal(verified.key, stepped.key) and torch.equal(verified.value, stepped.value)
    assert torch.equal(verified.conv, snapshots[0][0]) and torch.equal(verified.ssm, snapshots[0][1])
    verify_plan.keep(accepted)
    assert_kept(verified, snapshots, accepted)


def assert_sixteen_rows_keep_their_own_counts(model, ssm_scale: float | None = None) -> None:
    """16 rows of 5 tokens from random positions (crossing KV blocks of 16), every count 1 … 5 among them: the
    verification and keep of one plan against 5 plain steps of another over the same random states."""
    stepped = random_pool(model, slots=16, capacity=24, seed=4, ssm_scale=ssm_scale)
    step_plan, verify_plan = DecodePlan(model, stepped), DecodePlan(model, clone(stepped), tokens_per_row=5)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.config.vocab_size, (16, 5), generator=g).tolist()
    positions = torch.randint(0, 18, (16,), generator=g).tolist()
    accepted = [1 + i % 5 for i in range(16)]
    assert_verification_and_keep_equal_plan_steps(step_plan, verify_plan, tokens, positions, accepted)


def assert_forced_acceptance_keeps_prefill_states(path: str | Path) -> None:
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: the accepted counts are the scripted ones, after every step each slot holds the states and KV entries
    of a fresh prefill of its kept tokens (within float tolerance), and the output is plain greedy decoding's."""
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=4, decode_plan=False)
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


def assert_speculation_equals(path: str | Path, speculative: SpeculativeConfig, expected: list[list[int]]) -> None:
    """Greedy speculation through plans gives `expected` twice (the second call reuses the first one's slots and
    plan), verifying 4 tokens per row, with drafts proposed."""
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=3, speculative=speculative)
    for _ in range(2):
        assert [r.token_ids for r in runner.generate(PROMPTS, GREEDY)] == expected, speculative.method
    plan = runner._scheduler.workspace.plan
    assert isinstance(plan, DecodePlan) and plan.tokens_per_row == 4
    assert runner.spec_stats()["num_draft_tokens"] > 0
