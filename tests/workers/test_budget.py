"""The step's token budget and the paged KV block table, against scripted inputs."""

from __future__ import annotations

import pytest
import torch

from workers.budget import TokenBudget
from workers.memory import parse_memory_size
from workers.model.kv_blocks import NULL_BLOCK, BlockTable


def test_short_prompts_share_a_forward_while_rows_times_the_widest_fit():
    budget = TokenBudget(64)
    assert budget.prefill_chunks([10, 20, 30]) == [10, 20]  # 3 rows × 30 = 90 > 64
    assert budget.prefill_chunks([16, 16, 16, 16, 1]) == [16, 16, 16, 16]
    assert budget.prefill_chunks([]) == []


def test_a_long_prompt_runs_alone_in_chunks_of_the_budget_and_continued_ones_share():
    budget = TokenBudget(64)
    assert budget.prefill_chunks([100, 5]) == [64]
    assert budget.prefill_chunks([36, 5]) == [36]  # the rest of a chunked prompt
    assert budget.prefill_chunks([5, 100]) == [5]  # the long one waits for the next step, alone


def test_verification_drafts_shrink_so_rows_times_k_plus_one_fit():
    assert TokenBudget(4096).max_drafts(64, 4) == 4
    assert TokenBudget(64).max_drafts(16, 4) == 3  # 16 × 4 = 64
    assert TokenBudget(7).max_drafts(4, 4) == 0
    assert TokenBudget(1).max_drafts(1, 4) == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8"])
def test_a_bad_budget_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        TokenBudget(bad)


def test_blocks_follow_each_slot_and_come_back():
    table = BlockTable(num_slots=3, max_tokens_per_slot=40, num_blocks=8, block_size=16, device=torch.device("cpu"))
    assert table.max_blocks_per_slot == 3 and table.num_usable == 7
    table.ensure(0, 1)
    table.ensure(1, 17)
    table.ensure(0, 33)  # grows: blocks stay consecutive when the next one is free
    assert table.owned == [[1, 4, 5], [2, 3], []]
    assert table.tables[0].tolist() == [1, 4, 5] and table.tables[2].tolist() == [NULL_BLOCK] * 3
    assert table.contiguous_start(1, 32) == 2 * 16 and table.contiguous_start(0, 33) is None
    table.move(1, 2)
    assert table.owned[1] == [] and table.tables[2].tolist() == [2, 3, NULL_BLOCK]
    table.free_slot(0)
    table.ensure(1, 16)
    assert table.owned[1] == [1]  # the lowest free block first
    table.ensure(0, 48)  # 3 of the 4 free blocks
    with pytest.raises(RuntimeError, match="KV cache exhausted"):
        table.ensure(1, 48)  # 2 more, 1 free


def test_the_free_list_stays_bounded_over_a_workers_life():
    """10-block requests in a 40-block cache, 1,000 of them one after another, then in pairs, each growing block by
    block as decoding does: blocks taken as the next of a run are not left behind in the free heap, which holds at
    most one entry per block, and `reset()` leaves exactly the free blocks."""
    blocks = BlockTable(2, 160, 41, 16, torch.device("cpu"))
    for _ in range(1000):
        for num_tokens in range(16, 161, 16):
            blocks.ensure(0, num_tokens)
        blocks.free_slot(0)
        assert len(blocks._free) <= blocks.num_usable
    for _ in range(100):
        for num_tokens in range(16, 161, 16):
            blocks.ensure(0, num_tokens)
            blocks.ensure(1, num_tokens)
        blocks.free_slot(1)
        blocks.free_slot(0)
        assert len(blocks._free) <= blocks.num_usable
    blocks.ensure(0, 50)
    blocks.reset()
    assert sorted(blocks._free) == list(range(1, 41))


def test_reservations_bound_admission_and_new_blocks_are_zeroed():
    table = BlockTable(num_slots=4, max_tokens_per_slot=64, num_blocks=6, block_size=4, device=torch.device("cpu"))
    storage = torch.full((2, 6 * 4, 3), float("nan"))
    table.attach([storage])
    assert torch.equal(storage[:, :4], torch.zeros(2, 4, 3))  # the null block
    assert table.try_reserve(12) == 3 and table.try_reserve(8) == 2  # 3 + 2 of 5 usable blocks
    assert table.try_reserve(1) is None
    assert not table.can_ever_hold(21) and table.can_ever_hold(20)
    table.ensure(2, 5)
    assert not torch.isnan(storage[:, table.owned[2][0] * 4 : (table.owned[2][1] + 1) * 4]).any()
    table.release(2)
    assert table.try_reserve(8) == 2
    table.reset()
    assert table.num_reserved == 0 and all(not owned for owned in table.owned)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GB", 8 * 10**9),
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5g", 1_500_000_000),
        (1000, 1000),
        ("4096", 4096),
    ],
)
def test_memory_sizes_parse(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("bad", ["eight", "8XB", "-1GB", 0])
def test_bad_memory_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="max_memory"):
        parse_memory_size(bad)


def test_an_attention_free_model_is_checked_against_the_budget_too(checkpoint_dir):
    """No attention layer means no KV cache to size, but the weights, state slots and activations must still fit:
    a budget below them is refused naming the flag (it used to plan an unbounded cache and start anyway)."""
    import dataclasses

    from workers.memory import plan_memory
    from workers.model import load_checkpoint
    from workers.model.checkpoint.config import MAMBA

    model = load_checkpoint(str(checkpoint_dir("granite_dense"))).model
    model.config = dataclasses.replace(model.config, block_kinds=(MAMBA,) * len(model.config.block_kinds))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(ValueError, match="max_memory is too small"):
        plan_memory([model], torch.device("cpu"), torch.float32, weights // 2, 64, 4, 0)
    plan = plan_memory([model], torch.device("cpu"), torch.float32, 100 * weights, 64, 4, 0)
    assert plan.reserved_bytes > weights and plan.num_kv_blocks > 1


def test_the_mtp_proposers_pending_hidden_states_are_in_the_plan(checkpoint_dir):
    from workers.memory import plan_memory
    from workers.model import load_checkpoint
    from workers.spec_decode.mtp import pending_bytes

    model = load_checkpoint(str(checkpoint_dir("qwen3_5")), mtp=True).model
    args = ([model], torch.device("cpu"), torch.float32, 2**30, 256, 8, 3)
    extra = plan_memory(*args, mtp=True).reserved_bytes - plan_memory(*args).reserved_bytes
    assert extra == pending_bytes(model.config.hidden_size, torch.float32, 8, 3, 256) > 0
