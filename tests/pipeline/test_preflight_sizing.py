"""The preflight's sizing: the published configs give the sizes docs/tensor_parallel.md states, a model too large for
the GPUs is refused in seconds with one line naming what fits, a size that does not split the model is refused
naming the field (no Ray, no weights read)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

import pipeline.driver
from jobs.generate import main
from pipeline.config import ModelConfig, ScalingConfig
from pipeline.fit import (
    ACCELERATOR_MEMORY,
    ModelDoesNotFit,
    check_fit,
    check_on_cluster,
    cluster_device_memory,
    fit_request,
)
from pipeline.generate import build_generate_job
from tests import published_configs as published
from tests.pipeline.conftest import job_argv, job_config
from workers.memory import kv_bytes_per_token, state_bytes_per_slot
from workers.model import HybridConfig
from workers.model.distributed.layout import TensorParallel, shard_config
from workers.sizing import size_model

ROOT = Path(__file__).parents[2]
GB, MB, KB = 1e9, 1e6, 1e3

# (config, format, T, expert parallel) → (weights GB, state MB per slot, KV KB per token) per rank: the table of
# docs/tensor_parallel.md.
DOCUMENTED = [
    (published.QWEN3_NEXT_80B, "bfloat16", 1, False, 159.35, 77.3, 24.58),
    (published.QWEN3_NEXT_80B_FP8, "fp8", 1, False, 80.37, 77.3, 24.58),
    (published.QWEN3_NEXT_80B_FP8, "fp8", 2, False, 40.69, 38.6, 12.29),
    (published.QWEN3_NEXT_80B_FP8, "fp8", 8, True, 10.26, 9.7, 12.29),
    (published.QWEN3_5_397B, "bfloat16", 1, False, 792.69, 192.1, 30.72),
    (published.QWEN3_5_397B_FP8, "fp8", 1, False, 398.61, 192.1, 30.72),
    (published.QWEN3_5_397B_FP8, "fp8", 4, False, 100.81, 48.0, 15.36),
    (published.QWEN3_5_397B_FP8, "fp8", 8, False, 50.55, 24.0, 15.36),
    (published.NEMOTRON_H_56B, "bfloat16", 1, False, 112.65, 912.6, 40.96),
    (published.NEMOTRON_H_56B, "bfloat16", 2, False, 56.33, 456.3, 20.48),
    (published.NEMOTRON_H_56B, "bfloat16", 4, False, 28.16, 228.2, 10.24),
]


@pytest.mark.parametrize("raw,fmt,size,ep,weights,state,kv", DOCUMENTED)
def test_published_configs_give_the_documented_sizes(raw, fmt, size, ep, weights, state, kv):
    model = size_model(raw, fmt, size, ep)
    assert model.weight_bytes_per_rank / GB == pytest.approx(weights, rel=0.01)
    assert model.state_bytes_per_slot / MB == pytest.approx(state, rel=0.01)
    assert model.kv_bytes_per_token / KB == pytest.approx(kv, rel=0.01)
    assert f"{weights:.2f} GB" in (ROOT / "docs" / "tensor_parallel.md").read_text()


def test_published_fields_give_the_sizes_in_the_model_names():
    # The check that the recalled shape fields are right: 80B, 397B (of which 17B active: not checked), 56B.
    for raw, billions in [
        (published.QWEN3_NEXT_80B, 80),
        (published.QWEN3_5_397B, 397),
        (published.NEMOTRON_H_56B, 56),
    ]:
        assert size_model(raw, "bfloat16").num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_fp8_keeps_only_the_converted_linears_in_fp8():
    # Qwen3-Next FP8 at T = 1: everything but ~0.68 B parameters (embedding, head, routers, norms, conv, gates)
    # is FP8; those are bfloat16 (or float32: A_log, dt_bias and the zero-centred norms).
    model = size_model(published.QWEN3_NEXT_80B_FP8, "fp8")
    unconverted_bytes = model.weight_bytes_per_rank - model.fp8_bytes_per_rank
    assert 2 * 0.67e9 < unconverted_bytes < 2 * 0.70e9
    # Experts split 8 ways are 64 rows, not whole 128-row blocks: the loader dequantizes them, sizing says so …
    assert size_model(published.QWEN3_NEXT_80B_FP8, "fp8", 8).fp8_bytes_per_rank < 7 * GB
    # … and expert parallelism keeps whole experts, in FP8.
    assert size_model(published.QWEN3_NEXT_80B_FP8, "fp8", 8, True).fp8_bytes_per_rank > 9.5 * GB


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "nemotron_dense"])
def test_state_and_kv_are_the_memory_plans_on_the_local_config(family, checkpoint_dir):
    raw = json.loads((checkpoint_dir(family) / "config.json").read_text())
    local = shard_config(HybridConfig.from_hf_dict(raw), TensorParallel(0, 2))
    model = size_model(raw, "float32", 2, dtype="float32")
    import torch

    assert model.state_bytes_per_slot == state_bytes_per_slot(local, torch.float32)
    assert model.kv_bytes_per_token == kv_bytes_per_token(local, torch.float32)


def _request(raw, model="m", **options):
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_options = {k: v for k, v in options.items() if k in fields}
    scaling = ScalingConfig(**{k: v for k, v in options.items() if k not in fields})
    return fit_request(ModelConfig(model=model, **model_options), scaling, raw)


def test_the_targets_qwen3_next_fp8_on_one_h200_or_two_h100s_and_qwen3_5_at_tp_8():
    qwen3_next = dict(quantization="fp8", max_model_len=32768)
    check_fit(_request(published.QWEN3_NEXT_80B_FP8, **qwen3_next), ACCELERATOR_MEMORY["H200"], "an H200 worker")
    with pytest.raises(ModelDoesNotFit, match=r"--tensor-parallel-size 2 fits \(4\d\.\d GB per GPU\)$"):
        check_fit(_request(published.QWEN3_NEXT_80B_FP8, **qwen3_next), ACCELERATOR_MEMORY["H100"], "an H100 worker")
    request = _request(published.QWEN3_NEXT_80B_FP8, **qwen3_next, tensor_parallel_size=2)
    check_fit(request, ACCELERATOR_MEMORY["H100"], "an H100 worker")
    request = _request(published.QWEN3_5_397B_FP8, quantization="fp8", tensor_parallel_size=8)
    check_fit(request, ACCELERATOR_MEMORY["H100"], "an H100 worker")
    with pytest.raises(ModelDoesNotFit, match=r"--tensor-parallel-size 8 fits"):  # 5, 6, 7 split no head count
        check_fit(dataclasses.replace(request, tensor_parallel_size=4), ACCELERATOR_MEMORY["H100"], "an H100")


def test_a_bf16_load_of_an_fp8_checkpoint_is_told_to_keep_fp8():
    request = _request(published.QWEN3_NEXT_80B_FP8, max_model_len=32768)  # dequantized to bfloat16: 159 GB
    with pytest.raises(ModelDoesNotFit) as refusal:
        check_fit(request, ACCELERATOR_MEMORY["H200"], "an H200 worker", gpus_per_node=1)
    assert str(refusal.value).endswith("--quantization fp8 --tensor-parallel-size 1 fits (87.5 GB per GPU)")
    assert "\n" not in str(refusal.value)


def test_weights_that_fit_with_fewer_slots_name_the_largest_max_num_seqs():
    request = _request(published.NEMOTRON_H_56B, tensor_parallel_size=2, max_num_seqs=256)
    with pytest.raises(ModelDoesNotFit) as refusal:
        check_fit(request, ACCELERATOR_MEMORY["H100"], "an H100 worker")
    line = str(refusal.value)
    seqs = int(line.split("--max-num-seqs ")[1].split()[0])
    assert 30 <= seqs < 256 and line.endswith("; --tensor-parallel-size 8 fits 256")
    check_fit(dataclasses.replace(request, max_num_seqs=seqs), ACCELERATOR_MEMORY["H100"], "an H100 worker")
    with pytest.raises(ModelDoesNotFit):
        check_fit(dataclasses.replace(request, max_num_seqs=seqs + 1), ACCELERATOR_MEMORY["H100"], "an H100 worker")


def test_the_driver_sizes_by_the_gpu_nodes_accelerator_types():
    head = {"CPU": 4.0}
    h100 = {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
    h200 = {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H200": 1.0}
    assert cluster_device_memory([head, h200, h100]) == (ACCELERATOR_MEMORY["H100"], "an H100 worker", 8)
    request = _request(published.QWEN3_NEXT_80B_FP8, quantization="fp8", max_model_len=32768)
    assert check_on_cluster(request, [head, h200]) is None
    with pytest.raises(ModelDoesNotFit, match="an H100 worker may use"):
        check_on_cluster(request, [head, h200, h100])  # Ray may place a worker on the H100s
    assert "sizing skipped" in check_on_cluster(request, [head, {"CPU": 8.0, "GPU": 1.0}])


@pytest.fixture
def no_ray(monkeypatch):
    """Reaching Ray would mean the refusal came too late: fail instead."""

    def refuse(address):
        raise AssertionError("the job reached Ray")

    monkeypatch.setattr(pipeline.driver, "connect", refuse)


def _needs(model_dir: Path, size: int) -> int:
    """Bytes one rank of the tiny job needs at `size` ranks (what check_fit compares)."""
    raw = json.loads((model_dir / "config.json").read_text())
    request = _request(raw, str(model_dir), max_model_len=40, max_num_seqs=8, tensor_parallel_size=size)
    return check_fit(request, 10**15, "a GPU")


def test_a_tiny_checkpoint_too_large_for_gpu_memory_is_refused_in_seconds(
    checkpoint_dir, dataset, tmp_path, capsys, no_ray
):
    model = checkpoint_dir("qwen3_next")
    one, two = _needs(model, 1), _needs(model, 2)
    assert two < one
    memory = int((one + two) / 2 / 0.9)  # room for a rank of two, not for the whole model
    capsys.readouterr()
    start = time.perf_counter()
    assert main(job_argv(model, dataset, tmp_path / "out", "--gpu-memory", str(memory))) == 2
    assert time.perf_counter() - start < 5
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model "), lines
    assert "weights need" in lines[0] and lines[0].endswith(
        f"--tensor-parallel-size 2 fits ({two / 1e9:.1f} GB per GPU)"
    )
    assert not (tmp_path / "out").exists()
    # The size that fits is let through (the build ends before Ray; the fit is checked, nothing left to the driver).
    config = job_config(model, dataset, tmp_path / "out", gpu_memory=str(memory), tensor_parallel_size=2)
    assert build_generate_job(config).fit is None


def test_a_size_that_does_not_split_the_heads_is_refused_naming_the_field(
    checkpoint_dir, dataset, tmp_path, capsys, no_ray
):
    model = checkpoint_dir("qwen3_next")
    capsys.readouterr()
    assert main(job_argv(model, dataset, tmp_path / "out", "--tensor-parallel-size", "3")) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tensor-parallel-size 3: tensor_parallel_size=3 does not divide num_attention_heads=4" in line
    assert "sizes that split it: 2, 4" in line


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size (ScalingConfig.tensor_parallel_size) = 0"),
        (["--gpu-memory", "lots"], "--gpu-memory (ModelConfig.gpu_memory) = 'lots' is invalid"),
        (["--enable-expert-parallel", "--tensor-parallel-size", "2"], "--enable-expert-parallel is for MoE models"),
    ],
)
def test_bad_parallel_flags_are_refused_in_one_line(flags, message, checkpoint_dir, dataset, tmp_path, capsys, no_ray):
    capsys.readouterr()
    assert main(job_argv(checkpoint_dir("bamba"), dataset, tmp_path / "out", *flags)) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
