"""Block-wise FP8 checkpoints (Qwen3-Next / Qwen3.5 FP8's layout): float8_e4m3fn weights with `weight_scale_inv`
per block, the modules in `modules_to_not_convert` left as they are. Loaded, they must compute exactly what the
same model with the dequantized weights in float32 computes; quantized to int8 on top, they load too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers import ModelRunner
from workers.model.checkpoint.tensors import CheckpointTensors, fp8_block_size

BLOCK = [32, 16]  # smaller than the published [128, 128] so that the tiny weights span several blocks, cut at edges
NOT_CONVERTED = ("lm_head", "embed_tokens", "norm", "conv1d", "A_log", "dt_bias", ".D")
ROWS = [[5, 9, 30, 31, 4, 77, 12, 100, 3], [8, 8, 8, 9, 8, 8, 8, 9]]


def to_fp8(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(out / rows), ceil(in / cols)]): each block scaled to ±448."""
    rows, cols = block
    out_features, in_features = weight.shape
    scale = torch.empty(-(-out_features // rows), -(-in_features // cols))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448
    full = scale.repeat_interleave(rows, 0)[:out_features].repeat_interleave(cols, 1)[:, :in_features]
    return (weight / full).to(torch.float8_e4m3fn), scale


@pytest.fixture(scope="module")
def fp8_pair(checkpoint_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(an FP8 checkpoint of the qwen3_5_text fixture, the same weights dequantized into a float32 checkpoint)."""
    source = checkpoint_dir("qwen3_5_text")
    fp8, dequantized = (tmp_path_factory.mktemp(name) for name in ("fp8", "dequantized"))
    for target in (fp8, dequantized):
        shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    quantized, plain = {}, {}
    for key, value in tensors.items():
        if value.dim() != 2 or any(part in key for part in NOT_CONVERTED):
            quantized[key] = plain[key] = value
            continue
        weight, scale = to_fp8(value.float(), BLOCK)
        quantized[key], quantized[key + "_scale_inv"] = weight, scale
        plain[key] = CheckpointTensors._dequantize(CheckpointTensors([], tuple(BLOCK)), key, weight, scale)
    assert any(v.dtype == torch.float8_e4m3fn for v in quantized.values())
    save_file(quantized, fp8 / "model.safetensors")
    save_file(plain, dequantized / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK, "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, dequantized


def _scores(path: Path, **options) -> torch.Tensor:
    runner = ModelRunner.from_pretrained(str(path), **options)
    return torch.cat([torch.tensor(s.token_logprobs) for s in runner.score(ROWS)])


def test_fp8_checkpoint_computes_what_its_dequantized_weights_do(fp8_pair):
    fp8, dequantized = fp8_pair
    assert torch.equal(_scores(fp8), _scores(dequantized))  # same float32 weights, same arithmetic


def test_fp8_checkpoint_loads_into_int8(fp8_pair):
    fp8, dequantized = fp8_pair
    torch.testing.assert_close(_scores(fp8, quantization="int8"), _scores(dequantized, quantization="int8"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fp8_checkpoint_loads_on_cuda(fp8_pair):
    fp8, dequantized = fp8_pair
    torch.testing.assert_close(_scores(fp8, device="cuda"), _scores(dequantized), atol=2e-3, rtol=0)


def test_fp8_scale_of_the_wrong_shape_and_other_methods_are_refused(fp8_pair, tmp_path):
    fp8, _ = fp8_pair
    tensors = CheckpointTensors([fp8 / "model.safetensors"], (64, 64))  # blocks the scales were not made for
    key = next(k for k in tensors.keys() if k + "_scale_inv" in tensors._entries)
    with pytest.raises(ValueError, match="_scale_inv has shape .* expected .* in 64 × 64 blocks"):
        tensors.read(key)
    assert fp8_block_size({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    with pytest.raises(ValueError, match="quant_method='gptq'.*block-wise FP8"):
        fp8_block_size({"quantization_config": {"quant_method": "gptq", "bits": 4}})
