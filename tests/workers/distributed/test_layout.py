"""How a model splits over tensor-parallel ranks: local configs, slices and refusals (pure, no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.tiny_models import FAMILIES
from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import (
    TensorParallel,
    check_divisible,
    kv_heads,
    mamba_groups,
    shard_config,
    vocab_rows,
)

SPLIT_FAMILIES = sorted(FAMILIES) + ["falcon_h1", "kimi_linear", "lfm2_moe", "lfm3", "jamba_moe", "olmo_hybrid"]
SPLIT_FAMILIES += ["zamba2_lora"]


def config_of(checkpoint_dir, family: str) -> HybridConfig:
    """The normalised config of a tiny family checkpoint."""
    return HybridConfig.from_hf_dict(json.loads((checkpoint_dir(family) / "config.json").read_text()))


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_local_state_shapes_sum_to_the_whole(checkpoint_dir, family: str) -> None:
    config = config_of(checkpoint_dir, family)
    check_divisible(config, 2)
    (conv, window), state = config.recurrent_state_shapes()
    local = [shard_config(config, TensorParallel(rank, 2)) for rank in range(2)]
    shapes = [c.recurrent_state_shapes() for c in local]
    assert {s for s in shapes} == {shapes[0]}, "ranks hold equal shares"
    (local_conv, local_window), local_state = shapes[0]
    assert local_window == window
    if state[0]:
        assert local_state[0] * 2 == state[0] and local_state[1:] == state[1:]
    groups = config.mamba.num_groups if config.mamba is not None else None
    if groups is None or groups % 2 == 0:  # a replicated B/C group makes the conv wider than half
        assert local_conv * 2 == conv
    assert local[0].hidden_size == config.hidden_size and local[0].vocab_size == config.vocab_size
    assert local[0].attention.num_heads * 2 == config.attention.num_heads


def test_size_one_is_the_config_itself(checkpoint_dir) -> None:
    config = config_of(checkpoint_dir, "granite_moe")
    assert shard_config(config, TensorParallel()) is config


def test_replicated_kv_heads_and_groups() -> None:
    from workers.model.checkpoint.config import AttentionConfig

    attention = AttentionConfig(8, 2, 16, 0.25, False, None, 16)
    assert [kv_heads(attention, TensorParallel(r, 8)) for r in range(8)] == [(r // 4, 1) for r in range(8)]
    assert [kv_heads(attention, TensorParallel(r, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    assert [mamba_groups(1, TensorParallel(r, 4)) for r in range(4)] == [(0, 1)] * 4
    assert [mamba_groups(8, TensorParallel(r, 4)) for r in range(4)] == [(2 * r, 2) for r in range(4)]


def test_vocabulary_rows_cover_an_odd_vocabulary_once() -> None:
    rows = [vocab_rows(101, TensorParallel(r, 4)) for r in range(4)]
    assert rows == [(0, 26), (26, 26), (52, 26), (78, 23)]
    assert sum(n for _, n in rows) == 101


def test_mamba_norm_spans_ranks_when_groups_are_fewer(checkpoint_dir) -> None:
    config = config_of(checkpoint_dir, "granite_moe")
    one_group = dataclasses.replace(config, mamba=dataclasses.replace(config.mamba, num_groups=1))
    local = shard_config(one_group, TensorParallel(1, 2))
    assert local.mamba.num_groups == 1 and local.mamba.norm_span == 2
    assert local.mamba.conv_dim == one_group.mamba.intermediate_size // 2 + 2 * one_group.mamba.state_size


def test_refusals_name_the_field_and_the_sizes_that_fit(checkpoint_dir) -> None:
    config = config_of(checkpoint_dir, "qwen3_next")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide linear_num_key_heads=2 .*: 2"):
        check_divisible(config, 4)
    moe = config_of(checkpoint_dir, "granite_moe")
    odd = dataclasses.replace(moe, feed_forward=dataclasses.replace(moe.feed_forward, num_experts=3))
    check_divisible(odd, 2)  # inside each expert: the expert count does not matter
    with pytest.raises(ValueError, match=r"num_experts \(expert parallel\)=3 \(sizes that split it: 3\)"):
        check_divisible(odd, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="integer ≥ 1"):
        check_divisible(moe, 0)


def test_expert_parallel_keeps_experts_whole(checkpoint_dir) -> None:
    config = config_of(checkpoint_dir, "granite_moe")
    ff = config.feed_forward
    tensor = shard_config(config, TensorParallel(0, 2)).feed_forward
    expert = shard_config(config, TensorParallel(0, 2, expert_parallel=True)).feed_forward
    assert tensor.expert_intermediate_size * 2 == ff.expert_intermediate_size
    assert expert.expert_intermediate_size == ff.expert_intermediate_size
    assert expert.num_experts == tensor.num_experts == ff.num_experts  # the router sees every expert


def test_shard_rules_cut_pieces_pad_and_zero() -> None:
    import torch

    from workers.model.distributed.slices import Cut, ShardRule, rows

    full = torch.arange(24.0).view(6, 4)
    two_pieces = rows((0, 1), (3, 2))
    assert two_pieces.apply(full, 1).tolist() == [full[0].tolist(), full[3].tolist(), full[4].tolist()]
    both = ShardRule((Cut(0, ((4, 2),)), Cut(1, ((2, 2),))), pad_rows=1)
    assert both.apply(full, 0).tolist() == [[18.0, 19.0], [22.0, 23.0], [0.0, 0.0]]
    bias = rows((0, 6), rank0_only=True)
    assert bias.apply(full[:, 0], 0).tolist() == full[:, 0].tolist() and not bias.apply(full[:, 0], 1).any()
    assert full.sum() == 276  # the full tensor is never changed
