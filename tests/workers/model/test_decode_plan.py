"""Decode plans (a whole step in one native call) against the module-by-module native path, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.model.plan_checks import (
    GREEDY,
    PROMPTS,
    assert_plan_steps_equal_module_steps,
    assert_sixteen_rows_keep_their_own_counts,
    assert_verification_and_keep_equal_plan_steps,
    clone,
    generate,
    random_pool,
)
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import StatePool, load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason

# NoPE and partial-RoPE attention, SwiGLU and relu² MLPs, μP multipliers ≠ 1 (granite_dense); attention-only
# models with q/k/v biases (qwen2) and per-head q/k norms (qwen3).
# MoE blocks: softmax routing with a shared MLP (granite_moe), grouped sigmoid routing with a latent-free relu² MoE
# and a shared expert (nemotron_moe), Gated DeltaNet with a gated shared expert (qwen3_next, qwen3_5_moe).
MOE_PLANNED = ["granite_moe", "nemotron_moe", "qwen3_next", "qwen3_5_moe"]
PLANNED = ["granite_dense", "nemotron_dense", "bamba", "qwen2", "qwen3", *MOE_PLANNED]


@pytest.mark.parametrize("family", PLANNED)
def test_plan_steps_equal_the_module_path_bit_for_bit(checkpoint_dir, family):
    model = load_checkpoint(str(checkpoint_dir(family))).model
    assert unsupported_reason(model) is None
    reference = random_pool(model, slots=4, capacity=12, seed=0)
    # Batch sizes change between steps (requests finish): each size gets its own records over the same buffers.
    assert_plan_steps_equal_module_steps(
        model, reference, [3, 3, 4, 2, 1, 4], 12, first_position=lambda step: min(step + 5, 11), hidden=False
    )


@pytest.mark.parametrize("family", PLANNED)
def test_greedy_generation_is_the_same_with_and_without_plans(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    prompts = [[5, 9, 30, 31, 4, 77, 12], [8, 8, 8], [100, 3, 17, 250 % 128], [7]]  # 4 prompts, 3 slots
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 16, 9)]
    outputs = {}
    for decode_plan in (True, False):
        runner = ModelRunner.from_pretrained(path, max_num_seqs=3, decode_plan=decode_plan)
        outputs[decode_plan] = [r.token_ids for r in runner.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    assert [len(tokens) for tokens in outputs[True]] == [12, 5, 16, 9]


def test_models_outside_the_plan_say_why_and_generate_on_the_module_path(checkpoint_dir):
    for family in ("granite_dense", "granite_moe"):
        model = load_checkpoint(str(checkpoint_dir(family)), decode_kernel="torch").model
        assert "native kernels are off" in unsupported_reason(model)
        with pytest.raises(ValueError, match="cannot run as a decode plan"):
            DecodePlan(model, StatePool(model.config, 2, 8, torch.device("cpu"), torch.float32))
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_moe")), decode_plan=True, decode_kernel="torch")
    result = runner.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(result.token_ids) == 4


def test_plan_refuses_bad_input_before_it_can_corrupt_memory(checkpoint_dir):
    model = load_checkpoint(str(checkpoint_dir("granite_dense"))).model
    plan = DecodePlan(model, random_pool(model, slots=2, capacity=8, seed=0))
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"token id outside \[0, {vocab}\)"):
        plan.run([vocab], [0])
    with pytest.raises(ValueError, match="position outside the KV cache"):
        plan.run([1, 2], [3, 8])
    with pytest.raises(ValueError, match=r"1 … 2 rows"):
        plan.run([1, 2, 3], [0, 0, 0])
    with pytest.raises(ValueError, match=r"1 … 2 rows"):
        plan.run([], [])


@pytest.mark.parametrize("family", PLANNED)
def test_verification_and_keep_equal_plain_plan_steps_bit_for_bit(checkpoint_dir, family):
    model = load_checkpoint(str(checkpoint_dir(family))).model
    stepped = random_pool(model, slots=3, capacity=16, seed=2)
    step_plan, verify_plan = DecodePlan(model, stepped), DecodePlan(model, clone(stepped), tokens_per_row=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=g).tolist()  # [x_last, d_1, d_2, d_3]
    positions, accepted = [5, 0, 11], [2, 4, 1]  # num_accepted_tokens per row: keep the state after input n − 1
    assert_verification_and_keep_equal_plan_steps(step_plan, verify_plan, tokens, positions, accepted)
    with pytest.raises(RuntimeError, match="needs a verification"):
        verify_plan.keep(accepted)
    verify_plan.verify(tokens, positions)
    with pytest.raises(ValueError, match=r"accepted counts must be 1 … 4"):
        verify_plan.keep([0, 4, 1])


@pytest.mark.parametrize("family", [*PLANNED, "qwen3_5_text", "qwen3_next_dense"])  # Mamba2 (1 and 2 groups), GDN
def test_verification_leaves_the_states_and_keep_advances_every_row_by_its_own_count(checkpoint_dir, family):
    """16 rows, 5 tokens each, every count 1 … 5 among them: verification gives the logits and KV entries of 5 plain
    steps, reads the recurrent states (conv windows, SSM or delta-rule states) and leaves them as they were; keep then
    gives each row the state of its own number of plain steps."""
    model = load_checkpoint(str(checkpoint_dir(family))).model
    assert_sixteen_rows_keep_their_own_counts(model)


@pytest.mark.parametrize(
    "family, method, draft_family",
    [
        ("granite_dense", "ngram", None),
        ("bamba", "draft", "draft_hybrid"),
        ("bamba", "draft", "bamba"),
        ("granite_moe", "draft", "granite_moe"),
        ("qwen3_5_moe", "draft", "qwen3_5_moe"),
    ],
)  # some drafts accepted / none (every row re-runs from its saved state) / all (the in-place state is kept)
def test_speculative_greedy_through_plans_equals_plain_greedy(checkpoint_dir, family, method, draft_family):
    path = str(checkpoint_dir(family))
    draft = str(checkpoint_dir(draft_family)) if draft_family else None
    expected, _ = generate(path, decode_plan=False)
    spec = ModelRunner.from_pretrained(
        path, max_num_seqs=3, speculative=SpeculativeConfig(method, 3, draft_model=draft, policy="fixed")
    )
    for _ in range(2):  # the second call reuses the first one's slots and plan
        assert [r.token_ids for r in spec.generate(PROMPTS, GREEDY)] == expected
    assert spec._scheduler.workspace.plan is not None and spec._scheduler.workspace.plan.tokens_per_row == 4
    stats = spec.spec_stats()
    drafted, accepted = stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]
    expected_acceptance = {None: 0 < accepted < drafted, "draft_hybrid": accepted == 0 < drafted}
    assert expected_acceptance.get(draft_family, 0 < accepted == drafted)


def test_runners_reuse_slots_and_plans_only_when_they_fit(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_dense")), max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = runner.generate([[5, 6, 7], [8, 9]], params)
    workspace = runner._scheduler.workspace
    assert [r.token_ids for r in runner.generate([[5, 6, 7]], params)] == [first[0].token_ids]
    assert runner._scheduler.workspace is workspace  # fewer slots, shorter: reused
    runner.generate([[5, 6, 7]] * 3, params)
    assert (
        runner._scheduler.workspace is not workspace and runner._scheduler.workspace.pool.num_slots == 3
    )  # more slots: new


def test_draft_model_steps_through_plans_propose_what_the_module_path_proposes():
    models = Path(__file__).resolve().parents[3] / "examples" / "models"
    target, draft = str(models / "demo-target"), str(models / "demo-draft")
    prompts = [
        [int(t) for t in torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(n))] for n in (12, 5, 20)
    ]
    prompts[0] = prompts[0][:6] * 2  # copy-heavy: drafts get accepted
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [r.token_ids for r in ModelRunner.from_pretrained(target, dtype="float32").generate(prompts, params)]
    stats = {}
    for decode_plan in (True, False):
        spec = SpeculativeConfig("draft", 4, draft_model=draft, policy="fixed")
        runner = ModelRunner.from_pretrained(target, dtype="float32", speculative=spec, decode_plan=decode_plan)
        assert [r.token_ids for r in runner.generate(prompts, params)] == expected
        stats[decode_plan] = runner.spec_stats()
    assert stats[True] == stats[False] and stats[True]["num_accepted_draft_tokens"] > 0
