"""Decode plans (a whole step in one native call) against the module-by-module native path, bit for bit."""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams
from workers.model import ForwardBatch, StatePool, load_checkpoint
from workers.model.decode_plan import DecodePlan, unsupported_reason

# NoPE and partial-RoPE attention, SwiGLU and relu² MLPs, μP multipliers ≠ 1 (granite_dense).
PLANNED = ["granite_dense", "nemotron_dense", "bamba"]


def _random_pool(model, slots: int, capacity: int, seed: int) -> StatePool:
    pool = StatePool(model.config, slots, capacity, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    for buffer in (pool.conv, pool.ssm, pool.key, pool.value):
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    return pool


def _clone(pool: StatePool) -> StatePool:
    copy = StatePool.__new__(StatePool)
    copy.__dict__.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in pool.__dict__.items()})
    return copy


def _module_step(model, pool: StatePool, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    b = len(token_ids)
    slots, cache_lens = torch.arange(b), torch.tensor(positions)
    batch = ForwardBatch(slots, cache_lens, torch.ones_like(cache_lens), slots_are_prefix=True, one_token_each=True)
    with torch.inference_mode():
        out = model(torch.tensor(token_ids)[:, None], batch, pool.prefix(b), pool.kv_caches(), in_place=True)
        return model.logits(out.hidden[:, 0])


@pytest.mark.parametrize("family", PLANNED)
def test_plan_steps_equal_the_module_path_bit_for_bit(checkpoint_dir, family):
    model = load_checkpoint(str(checkpoint_dir(family))).model
    assert unsupported_reason(model) is None
    reference = _random_pool(model, slots=4, capacity=12, seed=0)
    planned = _clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    # Batch sizes change between steps (requests finish): each size gets its own records over the same buffers.
    for step, b in enumerate([3, 3, 4, 2, 1, 4]):
        token_ids = torch.randint(0, model.config.vocab_size, (b,), generator=g).tolist()
        positions = torch.randint(0, 12, (b,), generator=g).tolist()
        positions[0] = min(step + 5, 11)
        expected = _module_step(model, reference, token_ids, positions)
        assert torch.equal(plan.run(token_ids, positions), expected), f"step {step}"
        for name in ("conv", "ssm", "key", "value"):
            assert torch.equal(getattr(planned, name), getattr(reference, name)), f"{name} after step {step}"


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
    for family in ("granite_moe", "nemotron_moe"):
        model = load_checkpoint(str(checkpoint_dir(family))).model
        assert "moe blocks are not covered" in unsupported_reason(model)
        with pytest.raises(ValueError, match="cannot run as a decode plan"):
            DecodePlan(model, StatePool(model.config, 2, 8, torch.device("cpu"), torch.float32))
    torch_model = load_checkpoint(str(checkpoint_dir("granite_dense")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_moe")), decode_plan=True)
    result = runner.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(result.token_ids) == 4


def test_plan_refuses_bad_input_before_it_can_corrupt_memory(checkpoint_dir):
    model = load_checkpoint(str(checkpoint_dir("granite_dense"))).model
    plan = DecodePlan(model, _random_pool(model, slots=2, capacity=8, seed=0))
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"token id outside \[0, {vocab}\)"):
        plan.run([vocab], [0])
    with pytest.raises(ValueError, match="position outside the KV cache"):
        plan.run([1, 2], [3, 8])
    with pytest.raises(ValueError, match=r"1 … 2 rows"):
        plan.run([1, 2, 3], [0, 0, 0])
    with pytest.raises(ValueError, match=r"1 … 2 rows"):
        plan.run([], [])
