"""Sharded loading of block-wise FP8 checkpoints: dequantized shares equal the dequantized full tensor cut; with
`quantization="fp8"` a share cut along the 128 × 128 blocks stays FP8 (its bytes and scale rows / columns cut to
match, dequantizing to exactly the full tensor's cut), and a share cut inside a block is dequantized and reported."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.workers.distributed.test_sharded_load import HalvedMlpModel, _load, check_every_share
from tests.workers.model.test_fp8_checkpoint import to_fp8
from tests.workers.model.test_fp8_kept import write_fp8
from workers.model import loader
from workers.model.checkpoint.tensors import CheckpointTensors
from workers.model.distributed.slices import Cut, ShardRule, columns, cut_state_dict, rows
from workers.model.fp8_shards import Fp8Shards, block_aligned
from workers.model.kernels.fp8 import dequantize_fp8_blocks
from workers.model.layers.feed_forward import MLP
from workers.model.layers.fp8_linear import Fp8BlockLinear
from workers.model.shard_reads import read_shard, read_source
from workers.model.weight_fill import Source


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])  # dense; per-expert FP8 keys
def test_dequantized_fp8_shares_equal_the_full_tensor_cut(family, checkpoint_dir, tmp_path):
    write_fp8(checkpoint_dir(family), tmp_path, [32, 16])  # several blocks per tiny weight, cut at the edges
    check_every_share(tmp_path, family, exact_bytes=False)


@pytest.fixture(scope="module")
def block_tensors(tmp_path_factory) -> CheckpointTensors:
    """FP8 weights in 128 × 128 blocks: `a` [512, 256], `gate` and `up` [256, 256] (one weight concatenated),
    `edge` [300, 200] (blocks cut at its edges)."""
    generator = torch.Generator().manual_seed(0)
    stored = {}
    for key, shape in {"a": (512, 256), "gate": (256, 256), "up": (256, 256), "edge": (300, 200)}.items():
        stored[key], stored[key + "_scale_inv"] = to_fp8(torch.randn(shape, generator=generator), [128, 128])
    path = tmp_path_factory.mktemp("fp8_blocks") / "model.safetensors"
    save_file(stored, path)
    return CheckpointTensors([path], (128, 128))


def _rule_cases(rank: int) -> list[tuple[tuple[str, ...], ShardRule, bool]]:
    """(keys, rank's rule, whether it keeps whole blocks)."""
    r = rank
    return [
        (("a",), rows((256 * r, 256)), True),
        (("a",), columns((128 * r, 128)), True),
        (("a",), rows((128 * r, 128), (256 + 128 * r, 128)), True),  # two pieces, like Mamba2's z_r | x_r
        (("a",), ShardRule((Cut(1, ((128 * r, 128),)), Cut(0, ((256 * r, 256),)))), True),
        (("a",), ShardRule((Cut(0, ((256 * r, 256),)),), pad_rows=5), True),
        (("a",), rows((256 * r, 256), rank0_only=True), True),
        (("a",), rows((64 * r, 64)), False),  # 64 rows: half a block
        (("a",), columns((192 * r, 64)), False),
        (("gate", "up"), rows((128 * r, 128), (256 + 128 * r, 128)), True),  # gate_r | up_r
        (("gate", "up"), rows((64 * r, 64), (256 + 64 * r, 64)), False),
        (("edge",), rows(((0, 256), (256, 44))[r]), True),  # the last piece ends at the tensor's end
        (("edge",), columns(((0, 128), (128, 72))[r]), True),
        (("edge",), rows((0, 128), (256, 44)) if r else rows((256, 44), (0, 128)), r == 1),  # a partial block first
        (("edge",), columns((100 * r, 100)), False),
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_block_aligned_shares_stay_fp8_and_dequantize_to_the_full_cut(block_tensors, rank):
    tensors = block_tensors
    for keys, rule, aligned in _rule_cases(rank):
        source = Source(keys, "cat" if len(keys) > 1 else "one")
        full_shape = (sum(tensors.shapes[k][0] for k in keys), tensors.shapes[keys[0]][1])
        assert block_aligned(rule, full_shape) == aligned, (keys, rule)
        shards = Fp8Shards(tensors, rank)
        shards.choose({"w.weight": keys}, {"w.weight": rule})
        want = rule.apply(read_source(source, tensors), rank)  # the dequantized full weight, cut
        if not aligned:
            assert shards.dequantized == ["w.weight"] and not shards.kept
            assert torch.equal(read_shard(source, rule, rank, tensors, full_shape), want)
            continue
        assert shards.kept == {"w.weight": ("w.weight",)} and shards.checkpoint_keys() == set(keys)
        before = tensors.bytes_read
        weight, scale = shards.read_fp8("w.weight")
        read = tensors.bytes_read - before
        assert weight.dtype == torch.uint8 and tuple(weight.shape) == shards.shapes["w.weight"] == tuple(want.shape)
        assert torch.equal(dequantize_fp8_blocks(weight, scale), want), (keys, rule)
        if rule.cuts and rule.cuts[0].dim == 0 and not (rule.rank0_only and rank):
            assert read < sum(tensors.shapes[k][0] * tensors.shapes[k][1] for k in keys)  # only the rank's rows


@pytest.fixture(scope="module")
def fp8_dir(checkpoint_dir, tmp_path_factory):
    """qwen3_5_text in FP8 with 128 × 128 blocks: every tiny weight is one (cut) block."""
    target = tmp_path_factory.mktemp("fp8_128")
    write_fp8(checkpoint_dir("qwen3_5_text"), target, [128, 128])
    return target


def test_a_rank_keeps_fp8_where_its_cut_follows_the_blocks(fp8_dir, monkeypatch):
    monkeypatch.setattr(loader, "HybridModel", HalvedMlpModel)  # only the MLPs split: 48 of 96 rows, off-block
    whole = _load(fp8_dir, quantization="fp8")
    dequantized = _load(fp8_dir).model.state_dict()
    whole_kept = {n: m for n, m in whole.model.named_modules() if isinstance(m, Fp8BlockLinear)}
    mlp_names = {n for n, m in whole.model.named_modules() if isinstance(m, MLP)}
    assert whole.summary.fp8_kept_bytes == sum(m.weight.numel() + 4 * m.scale_inv.numel() for m in whole_kept.values())
    assert not whole.summary.fp8_dequantized and mlp_names
    for rank in (0, 1):
        share = _load(fp8_dir, rank, 2, quantization="fp8")
        kept = {n: m for n, m in share.model.named_modules() if isinstance(m, Fp8BlockLinear)}
        moved = {f"{n}.{p}_proj.weight" for n in mlp_names for p in ("up", "down")} & {
            f"{n}.weight" for n in whole_kept
        }
        assert moved and set(share.summary.fp8_dequantized) == moved  # reported, loaded as float weights
        assert set(kept) == set(whole_kept) - {name.removesuffix(".weight") for name in moved}
        assert 0 < share.summary.fp8_kept_bytes < whole.summary.fp8_kept_bytes
        for name, module in kept.items():  # replicated: the checkpoint's bytes as they are
            assert torch.equal(module.weight, whole_kept[name].weight) and torch.equal(
                module.scale_inv, whole_kept[name].scale_inv
            )
        state = share.model.state_dict()
        expected = cut_state_dict(share.model, {k: v for k, v in dequantized.items() if k in state}, rank)
        for name in moved:
            assert torch.equal(state[name], expected[name]), name
        assert "dequantized" in share.summary.line()
