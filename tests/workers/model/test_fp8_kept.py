"""`quantization="fp8"`: a block-wise FP8 checkpoint's linears stay FP8 in memory (`Fp8BlockLinear`), ~1 byte per
weight, and compute what the dequantized load computes (the same float32 weights, dequantized per call)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.model.test_fp8_checkpoint import NOT_CONVERTED, ROWS, to_fp8
from workers import ModelRunner
from workers.model.kernels.fp8 import dequantize_fp8_blocks
from workers.model.layers.fp8_linear import Fp8BlockLinear
from workers.model.loader import load_checkpoint

BLOCK = [128, 128]  # the only block size kept in FP8; the tiny weights are one block each, cut at the edges


def write_fp8(source: Path, target: Path, block: list[int]) -> int:
    """Copy the checkpoint at `source` to `target` with its 2-D block weights in block-wise FP8; returns how many
    weights were converted."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    tensors, converted = load_file(source / "model.safetensors"), 0
    out = {}
    for key, value in tensors.items():
        if value.dim() != 2 or any(part in key for part in NOT_CONVERTED):
            out[key] = value
            continue
        out[key], out[key + "_scale_inv"] = to_fp8(value.float(), block)
        converted += 1
    save_file(out, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
        "modules_to_not_convert": ["lm_head"],
    }
    (target / "config.json").write_text(json.dumps(config))
    return converted


@pytest.fixture(scope="module")
def fp8_dir(checkpoint_dir, tmp_path_factory) -> Path:
    """The qwen3_5_text fixture in block-wise FP8 with 128 × 128 blocks."""
    target = tmp_path_factory.mktemp("fp8_128")
    assert write_fp8(checkpoint_dir("qwen3_5_text"), target, BLOCK) > 0
    return target


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers (each tensor once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_kept_linears_hold_one_byte_per_weight(fp8_dir):
    model = load_checkpoint(str(fp8_dir), quantization="fp8").model
    kept = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(kept) >= 4  # each block's attention / mixer out projections and the MLPs' at least
    num_weights = sum(m.in_features * m.out_features for m in kept)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in kept)
    scale_bytes = sum(m.scale_inv.numel() * 4 for m in kept)
    assert weight_bytes == num_weights and scale_bytes <= 4 * len(kept) * 4
    assert all(m.weight.dtype == torch.uint8 for m in kept)
    assert not any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.uint8 for m in model.modules())
    plain_model = load_checkpoint(str(fp8_dir), linear_backend="torch").model
    plain = dict(plain_model.named_modules())
    fp8_model = load_checkpoint(str(fp8_dir), linear_backend="torch", quantization="fp8").model
    saved = model_bytes(plain_model) - model_bytes(fp8_model)  # float32 → 1 byte per kept weight, + the scales
    assert saved == 3 * num_weights - scale_bytes
    for name, module in model.named_modules():  # the bytes and scales are the checkpoint's: they dequantize to
        if isinstance(module, Fp8BlockLinear):  # exactly the weights the dequantized load holds
            assert torch.equal(dequantize_fp8_blocks(module.weight, module.scale_inv), plain[name].weight), name


def _scores(path: Path, **options) -> torch.Tensor:
    runner = ModelRunner.from_pretrained(str(path), **options)
    return torch.cat([torch.tensor(s.token_logprobs) for s in runner.score(ROWS)])


def test_kept_fp8_scores_equal_the_dequantized_load(fp8_dir):
    kept = _scores(fp8_dir, quantization="fp8")
    dequantized = _scores(fp8_dir)
    torch.testing.assert_close(kept, dequantized, rtol=1e-5, atol=1e-5)  # the same weights, another kernel


def test_kept_fp8_generates_the_dequantized_load_tokens(fp8_dir):
    from workers import SamplingParams

    prompts = [[5, 9, 30, 31], [8, 8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = [
        ModelRunner.from_pretrained(str(fp8_dir), **o).generate(prompts, params) for o in ({}, {"quantization": "fp8"})
    ]
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]


def test_fp8_block_linear_matches_the_reference_linear():
    weight, scale = to_fp8(torch.randn(300, 200), BLOCK)
    bias = torch.randn(300)
    layer = Fp8BlockLinear(weight.view(torch.uint8), scale, bias)
    x = torch.randn(2, 3, 200)
    expected = torch.nn.functional.linear(x, dequantize_fp8_blocks(weight.view(torch.uint8), scale), bias)
    assert torch.equal(layer(x), expected)
    assert layer(x.double()).dtype == torch.float64


def test_fp8_option_refuses_other_checkpoints(checkpoint_dir, tmp_path):
    plain = checkpoint_dir("qwen3_5_text")
    with pytest.raises(ValueError, match=r"quantization='fp8' keeps a block-wise FP8 .* is not one"):
        load_checkpoint(str(plain), quantization="fp8")
    write_fp8(plain, tmp_path, [32, 16])
    with pytest.raises(ValueError, match=r"needs 128 × 128 weight blocks, but .* uses 32 × 16"):
        load_checkpoint(str(tmp_path), quantization="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_kept_fp8_on_cuda_matches_the_dequantized_load(fp8_dir):
    model = load_checkpoint(str(fp8_dir), device="cuda", quantization="fp8").model
    assert any(isinstance(m, Fp8BlockLinear) and m.weight.is_cuda for m in model.modules())
    torch.testing.assert_close(_scores(fp8_dir, device="cuda", quantization="fp8"), _scores(fp8_dir), atol=2e-3, rtol=0)


def test_fused_weights_stay_fp8_only_at_block_boundaries():
    from types import SimpleNamespace

    from workers.model.checkpoint.weights import Source
    from workers.model.layers.fp8_linear import fill_fp8_linears, fp8_kept_sources, keep_fp8_linears

    gate, up = to_fp8(torch.randn(256, 200), BLOCK), to_fp8(torch.randn(70, 200), BLOCK)
    stored = {key: (w.view(torch.uint8), s) for key, (w, s) in {"gate": gate, "up": up, "cut": up}.items()}
    tensors = SimpleNamespace(
        shapes={key: tuple(weight.shape) for key, (weight, _) in stored.items()} | {"plain": (8, 200)},
        is_fp8=stored.__contains__,
        read_fp8=stored.__getitem__,
    )
    plan = {
        "a.weight": Source(("gate", "up"), "cat"),  # 256 rows then 70: the blocks line up
        "b.weight": Source(("cut", "gate"), "cat"),  # 70 rows first: a block would straddle the two
        "c.weight": Source(("gate", "plain"), "cat"),  # one part is not FP8
        "d.weight": Source(("gate",), transform=lambda parts: parts[0]),
    }
    kept = fp8_kept_sources(plan, tensors)
    assert kept == {"a.weight": ("gate", "up")}
    with torch.device("meta"):
        module = torch.nn.Module()
        module.a = torch.nn.Linear(200, 326)
    assert keep_fp8_linears(module, kept, tensors) == 1
    module = module.to(torch.float64).to_empty(device="cpu")
    fill_fp8_linears(module, kept, tensors)
    expected = torch.cat([dequantize_fp8_blocks(*stored["gate"]), dequantize_fp8_blocks(*stored["up"])])
    assert isinstance(module.a, Fp8BlockLinear) and module.a.scale_inv.dtype == torch.float32
    assert torch.equal(dequantize_fp8_blocks(module.a.weight, module.a.scale_inv), expected)
    assert [name for name, _ in module.named_parameters()] == ["a.bias"]  # loaded from the checkpoint as before


def test_fp8_is_a_quantization_of_the_load_and_the_cli():
    from pipeline.config import QUANTIZATIONS as CLI_QUANTIZATIONS
    from workers.config import QUANTIZATIONS

    assert "fp8" in QUANTIZATIONS and "fp8" in CLI_QUANTIZATIONS
