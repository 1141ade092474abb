"""Sharded loading: a tensor-parallel rank reads only its share of the checkpoint, and gets exactly the full tensor
cut by its rule.

The oracle is `ShardRule.apply` on what a single rank loads (`read_source`). Every parameter of every tiny family's
checkpoint is read through `read_shard` with synthetic rules of each shape the layers state (rows, columns, a
two-piece row cut like Mamba2's in_proj, experts whole for expert parallelism, a cut inside each expert,
`rank0_only`, `pad_rows`), for ranks 0 and 1; a rows cut must read half the bytes where the layout allows it. The
whole `load_checkpoint(..., tp=...)` path runs with a stand-in model whose MLPs hold half the intermediate size.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import pytest
import torch

from tests.falcon_h1_models import FALCON_H1_FAMILIES
from tests.kimi_models import KIMI_FAMILIES
from tests.lfm_models import LFM_FAMILIES
from tests.tiny_jamba import JAMBA_FAMILIES
from tests.tiny_models import (
    FAMILIES,
    GDN_VARIANT_FAMILIES,
    MOE_VARIANT_FAMILIES,
    NEMOTRON_MTP_FAMILIES,
    QWEN_GDN_FAMILIES,
)
from tests.workers.model.olmo_hybrid_fixtures import OLMO_HYBRID_FAMILIES
from tests.zamba2_models import ZAMBA2_LAYOUTS
from workers.model import loader
from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import Cut, ShardRule, columns, cut_state_dict, rows
from workers.model.layers.feed_forward import MLP
from workers.model.layers.hybrid import HybridModel
from workers.model.shard_reads import read_shard, read_source
from workers.model.weight_fill import match_weights

ALL_FAMILIES = sorted(
    [*FAMILIES, *GDN_VARIANT_FAMILIES, *MOE_VARIANT_FAMILIES, *FALCON_H1_FAMILIES, *KIMI_FAMILIES]
    + [*LFM_FAMILIES, *JAMBA_FAMILIES, *OLMO_HYBRID_FAMILIES, *ZAMBA2_LAYOUTS]
)
WITH_MTP = (*NEMOTRON_MTP_FAMILIES, *QWEN_GDN_FAMILIES)


def halves(size: int, rank: int) -> tuple[int, int]:
    return rank * (size // 2), size // 2


def synthetic_rules(shape: tuple[int, ...], rank: int) -> dict[str, ShardRule]:
    """Rank `rank`'s rule of each kind that fits a tensor of `shape` (of 2 ranks)."""
    n = shape[0]
    found = {"whole": ShardRule(), "rank0_only": ShardRule(rank0_only=True)}
    if n % 2 == 0:
        found["rows"] = rows(halves(n, rank))
        found["rows_rank0_only"] = rows(halves(n, rank), rank0_only=True)
        found["rows_padded"] = ShardRule((Cut(0, (halves(n, rank),)),), pad_rows=3)
    if n % 4 == 0:  # [z_r | x_r]-like: two pieces of the rows
        q = n // 4
        found["two_pieces"] = rows((rank * q, q), (2 * q + rank * q, q))
    if len(shape) >= 2 and shape[1] % 2 == 0:
        found["columns"] = columns(halves(shape[1], rank))
        if n % 2 == 0:  # columns first: the rows cut is still read first
            found["columns_then_rows"] = ShardRule((Cut(1, (halves(shape[1], rank),)), Cut(0, (halves(n, rank),))))
    if len(shape) >= 3 and shape[1] % 4 == 0:  # inside each expert: [gate_r | up_r]
        q = shape[1] // 4
        found["inside_experts"] = rows((rank * q, q), (2 * q + rank * q, q), dim=1)
    if len(shape) >= 3 and shape[-1] % 2 == 0:  # an expert's columns, by a negative dim
        found["last_dim"] = columns(halves(shape[-1], rank), dim=-1)
    return found


def _plan(path, family: str):
    tensors = loader.open_tensors(path, loader.fp8_block_size(loader._read_json(path, "config.json")))
    config = HybridConfig.from_hf_dict(loader._read_json(path, "config.json"))
    with torch.device("meta"):
        model = HybridModel(config, mtp=family in WITH_MTP)
    plan = match_weights(model, dict(tensors.shapes))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    return tensors, plan, shapes


def _bytes(tensors, read) -> tuple[torch.Tensor, int]:
    before = tensors.bytes_read
    result = read()
    return result, tensors.bytes_read - before


def check_every_share(path, family: str, exact_bytes: bool = True) -> None:
    """Every parameter's share, by every synthetic rule, for ranks 0 and 1, equals the full tensor cut; a rows cut
    of a plain source reads half its bytes (`exact_bytes`; else fewer: an FP8 weight's scales are read whole)."""
    tensors, plan, shapes = _plan(path, family)
    kinds_seen, halved = set(), 0
    for name, source in plan.items():
        full, full_bytes = _bytes(tensors, partial(read_source, source, tensors))
        for rank in (0, 1):
            for kind, rule in synthetic_rules(shapes[name], rank).items():
                got, got_bytes = _bytes(tensors, partial(read_shard, source, rule, rank, tensors, shapes[name]))
                want = rule.apply(full, rank)
                assert got.dtype == want.dtype and torch.equal(got, want), (name, kind, rank, source.keys)
                kinds_seen.add(kind)
                if rule.rank0_only and rank:
                    assert got_bytes == 0, (name, kind)
                if kind == "rows" and source.transform is None and source.keys:  # only the rank's rows
                    assert 2 * got_bytes == full_bytes if exact_bytes else got_bytes < full_bytes, (name, source.keys)
                    halved += 1
    assert {"rows", "columns", "two_pieces", "rank0_only", "rows_padded"} <= kinds_seen
    assert halved > len(plan) // 2  # most parameters are plain rows of the checkpoint


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_share_equals_the_full_tensor_cut(family, checkpoint_dir):
    check_every_share(checkpoint_dir(family), family)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "jamba_moe", "kimi_linear", "lfm2_moe"])
def test_experts_read_only_the_local_experts_or_each_expert_cut(family, checkpoint_dir):
    tensors, plan, shapes = _plan(checkpoint_dir(family), family)
    experts = {name: source for name, source in plan.items() if name.endswith(("experts_up", "experts_down"))}
    assert experts
    for name, source in experts.items():
        num_experts = shapes[name][0]
        full, full_bytes = _bytes(tensors, partial(read_source, source, tensors))
        local = rows(halves(num_experts, 1))  # expert parallel: rank 1 holds the second half whole
        got, got_bytes = _bytes(tensors, partial(read_shard, source, local, 1, tensors, shapes[name]))
        assert torch.equal(got, local.apply(full, 1)) and 2 * got_bytes == full_bytes
        if name.endswith("experts_up"):  # per-expert keys or one fused tensor: only gate_r and up_r of each
            inside = synthetic_rules(shapes[name], 1)["inside_experts"]
            got, got_bytes = _bytes(tensors, partial(read_shard, source, inside, 1, tensors, shapes[name]))
            assert torch.equal(got, inside.apply(full, 1)) and 2 * got_bytes == full_bytes


def test_read_rows_refuses_rows_outside_the_tensor(checkpoint_dir):
    tensors, _, _ = _plan(checkpoint_dir("bamba"), "bamba")
    key = next(k for k in tensors.keys() if len(tensors.shapes[k]) == 2)
    with pytest.raises(ValueError, match="outside the"):
        tensors.read_rows(key, [(tensors.shapes[key][0] - 1, 2)])


# The loader's whole path, before the layers state their rules (S2): a stand-in model whose MLPs hold rank r's
# half of the intermediate size and state the MLP's rules (gate_r | up_r rows, down_proj columns, its bias on rank 0).


def mlp_rules(intermediate: int, gated: bool, bias: bool, tp: TensorParallel) -> dict[str, ShardRule]:
    start, length = tp.split(intermediate)
    up = (start, length), (intermediate + start, length)
    found = {"up_proj.weight": rows(*(up if gated else up[:1])), "down_proj.weight": columns((start, length))}
    if bias:
        found["up_proj.bias"] = rows(*(up if gated else up[:1]))
        found["down_proj.bias"] = ShardRule(rank0_only=True)
    return found


class HalvedMlpModel(HybridModel):
    """`HybridModel(config, mtp, tp)` with only the MLPs split (stand-in for the layers' own `tp`)."""

    def __init__(self, config: HybridConfig, mtp: bool = False, tp: TensorParallel = SINGLE_TP):
        ff = config.feed_forward
        local = dataclasses.replace(ff, intermediate_size=ff.intermediate_size // tp.size)
        super().__init__(dataclasses.replace(config, feed_forward=local), mtp=mtp)
        for module in self.modules():
            if isinstance(module, MLP) and tp.parallel:
                module.shard_rules = partial(mlp_rules, ff.intermediate_size, ff.gated, ff.bias, tp)


@pytest.fixture()
def halved_mlps(monkeypatch):
    monkeypatch.setattr(loader, "HybridModel", HalvedMlpModel)


def _load(path, rank: int = 0, size: int = 1, **options) -> loader.LoadedCheckpoint:
    tp = TensorParallel(rank, size)
    return loader.load_checkpoint(str(path), linear_backend="torch", decode_kernel="torch", tp=tp, **options)


@pytest.mark.parametrize("family", ["qwen3_5_text", "granite_dense"])  # gate and up: two keys; one fused key
def test_a_rank_loads_its_share_of_every_parameter(family, halved_mlps, checkpoint_dir, caplog):
    path = checkpoint_dir(family)
    whole = _load(path)
    full_state = whole.model.state_dict()
    outputs = []
    for rank in (0, 1):
        with caplog.at_level(logging.INFO, logger=loader.__name__):
            share = _load(path, rank, 2)
        assert f"rank {rank}/2 read " in caplog.text
        mlps = [m for m in share.model.modules() if isinstance(m, MLP)]
        assert mlps and all(m.down_proj.in_features == whole.config.feed_forward.intermediate_size // 2 for m in mlps)
        expected = cut_state_dict(share.model, full_state, rank)
        for name, tensor in share.model.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
        assert share.summary.rank == rank and share.summary.size == 2
        assert 0 < share.summary.bytes_read < whole.summary.bytes_read  # the MLPs' up rows: half read
        outputs.append(mlps[0](torch.randn(3, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))))
    full_mlp = next(m for m in whole.model.modules() if isinstance(m, MLP))
    x = torch.randn(3, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(outputs[0] + outputs[1], full_mlp(x), rtol=1e-5, atol=1e-6)  # partial sums add up


def test_a_rank_checks_the_checkpoint_against_the_whole_model(halved_mlps, checkpoint_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_5_text"), path)
    tensors = load_file(path / "model.safetensors")
    key = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[key] = tensors[key][:, : tensors[key].shape[1] // 2].contiguous()  # a rank's shape, not the model's
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"weight '{key}' has shape"):
        _load(path, 1, 2)


def test_tensor_parallel_sizes_the_model_cannot_split_are_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        _load(checkpoint_dir("qwen3_5_text"), 0, 3)
