"""Checkpoint loading: layouts (sharded, tied, both layer-type spellings, dtypes) and every error message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers import ModelRunner
from workers.model import load_checkpoint
from workers.model.checkpoint.config import HybridConfig
from workers.model.kernels import native, native_bf16
from workers.model.loader import resolve_dtype


def _copy(src, tmp_path, name="model"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def _logits(path, dtype="float32"):
    runner = ModelRunner.from_pretrained(str(path), dtype=dtype)
    return torch.tensor(runner.score([[5, 9, 12, 7, 30, 31, 4]])[0].token_logprobs)


def test_unsupported_model_type_lists_supported(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("bamba"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*granitemoehybrid, bamba, nemotron_h"):
        load_checkpoint(str(path))


def test_missing_weight_is_named(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("granite_moe"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weight \['model.layers.1.self_attn.k_proj.weight'\].*\(32, 64\)"):
        load_checkpoint(str(path))


def test_unexpected_weight_is_named(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("bamba"), tmp_path)
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mamba.surprise": torch.zeros(3, 2)}))
    with pytest.raises(ValueError, match=r"unexpected weight 'model.layers.0.mamba.surprise' with shape \(3, 2\)"):
        load_checkpoint(str(path))


def test_misshaped_weight_names_key_and_both_shapes(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("nemotron_dense"), tmp_path)
    _rewrite_weights(path, lambda t: t.update({"backbone.layers.0.mixer.out_proj.weight": torch.zeros(64, 100)}))
    with pytest.raises(
        ValueError, match=r"'backbone.layers.0.mixer.out_proj.weight' has shape \(64, 100\).*\(64, 128\)"
    ):
        load_checkpoint(str(path))


def test_pickle_weights_are_refused(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("bamba"), tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors weights only"):
        load_checkpoint(str(path))


def test_not_a_directory_nor_repo_id():
    with pytest.raises(ValueError, match="neither a model directory nor a hub repo id"):
        load_checkpoint("/no/such/model/dir")


def test_sharded_checkpoint_and_ignored_mtp_keys_load_the_same(tmp_path, checkpoint_dir):
    src = checkpoint_dir("nemotron_moe")
    path = _copy(src, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.layers.0.norm.weight"] = torch.ones(64)  # real Nemotron-H checkpoints carry MTP heads
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}  # fmt: skip
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, path / name)
    (path / "model.safetensors").unlink()
    weight_map = {k: name for name, part in halves.items() for k in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.testing.assert_close(_logits(path), _logits(src), atol=0, rtol=0)


def test_hub_layer_type_names_are_accepted(tmp_path, checkpoint_dir):
    src = checkpoint_dir("granite_dense")
    path = _copy(src, tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    config["layer_types"] = ["mamba", "mamba", "attention", "mamba"]
    (path / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(_logits(path), _logits(src), atol=0, rtol=0)


def test_nemotron_pattern_string_is_accepted():
    config = HybridConfig.from_hf_dict(
        {
            "model_type": "nemotron_h",
            "vocab_size": 10,
            "hidden_size": 8,
            "num_attention_heads": 2,
            "hybrid_override_pattern": "M-M*E",
            "mamba_num_heads": 2,
            "mamba_head_dim": 4,
            "n_routed_experts": 2,
        }
    )
    assert config.block_kinds == ("mamba", "mlp", "mamba", "attention", "moe")


def test_tied_embeddings_share_one_tensor(checkpoint_dir):
    loaded = load_checkpoint(str(checkpoint_dir("granite_dense")), linear_backend="torch")
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_stays_close(tmp_path, checkpoint_dir):
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint("granite_moe", tmp_path / "bf16", dtype=torch.bfloat16)
    assert load_checkpoint(str(path), dtype="auto").model.embed_tokens.weight.dtype == torch.float32
    config = HybridConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16  # a GPU keeps the checkpoint's dtype
    loaded = load_checkpoint(str(path), dtype="bfloat16", linear_backend="torch")  # the all-PyTorch bf16 model
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.blocks[0].mixer.A_log.dtype == torch.float32  # SSM parameters stay float32
    bf16 = _logits(path, dtype="bfloat16")
    fp32 = _logits(path, dtype="float32")
    assert (bf16 - fp32).abs().max() < 0.15
    if native.available() and native_bf16.bf16_path() == "portable":
        # bf16 weights × float32 activations, summed in k order as float32's panels are: with this checkpoint's
        # bf16-exact weights, float32's very logits (the AMX / AVX512-BF16 paths round activations too).
        assert torch.equal(bf16, fp32)
    else:
        assert (bf16 - fp32).abs().max() > 0  # really ran in bfloat16


def test_bad_dtype_lists_choices(checkpoint_dir):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported; choose one of: auto, float32"):
        load_checkpoint(str(checkpoint_dir("bamba")), dtype="int8")
