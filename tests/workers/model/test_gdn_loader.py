"""Gated DeltaNet checkpoints: the text-only Qwen3.5 layout, per-expert == fused experts, and named errors for
missing or mis-shaped linear-attention weights."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from tests.tiny_models import _QWEN, FAMILIES, make_tokenizer, randomise
from tests.workers.model.test_loader import _copy, _rewrite_weights
from workers import ModelRunner
from workers.model import load_checkpoint

SEQUENCES = [[5, 9, 12, 7, 30, 31, 4, 99, 100, 17, 3], [40, 41] * 12]


def _scores(path) -> torch.Tensor:
    runner = ModelRunner.from_pretrained(str(path))
    return torch.cat([torch.tensor(r.token_logprobs) for r in runner.score(SEQUENCES)])


def test_text_only_qwen3_5_layout_matches_transformers(tmp_path):
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_QWEN, intermediate_size=96))
    randomise(hf, 0, zero_centred_norms=True)
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert any(k.startswith("model.layers.0.linear_attn.") for k in load_file(tmp_path / "model.safetensors"))
    hf.eval()
    worst = 0.0
    for seq, ours in zip(SEQUENCES, ModelRunner.from_pretrained(str(tmp_path)).score(SEQUENCES)):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logprobs = hf(ids, position_ids=torch.arange(len(seq))[None]).logits.log_softmax(-1)
        reference = logprobs[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        worst = max(worst, (torch.tensor(ours.token_logprobs) - reference).abs().max().item())
    assert worst < 1e-4


def test_per_expert_and_fused_experts_load_the_same_model(tmp_path, checkpoint_dir):
    fused = checkpoint_dir("qwen3_5_moe")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(fused / "model.safetensors")
    torch.manual_seed(0)
    hf = FAMILIES["qwen3_5_moe"]()
    randomise(hf, 0, zero_centred_norms=True)  # the same seed and order as the fused checkpoint's build
    hf.save_pretrained(tmp_path)
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in load_file(tmp_path / "model.safetensors")
    assert torch.equal(_scores(tmp_path), _scores(fused))


def test_missing_gdn_projection_is_named(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("qwen3_5"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.language_model.layers.1.linear_attn.in_proj_b.weight"))
    with pytest.raises(ValueError, match=r"missing weight \['model.language_model.layers.1.linear_attn.in_proj_b"):
        load_checkpoint(str(path))


def test_missing_grouped_gdn_projection_is_named(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("qwen3_next"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.0.linear_attn.in_proj_ba.weight"))
    with pytest.raises(ValueError, match=r"missing weight \['model.layers.0.linear_attn.in_proj_ba.weight'\]"):
        load_checkpoint(str(path))


@pytest.mark.parametrize(
    ("family", "key", "shape", "expected"),
    [
        ("qwen3_5", "model.language_model.layers.0.linear_attn.in_proj_qkv.weight", (60, 64), (128, 64)),
        ("qwen3_next", "model.layers.3.linear_attn.in_proj_qkvz.weight", (190, 64), (192, 64)),
        ("qwen3_5_moe", "model.language_model.layers.1.linear_attn.conv1d.weight", (128, 1, 3), (128, 1, 4)),
        ("qwen3_5_moe", "model.language_model.layers.0.linear_attn.A_log", (2,), (4,)),
    ],
)
def test_misshaped_gdn_weight_names_key_and_shapes(family, key, shape, expected, tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir(family), tmp_path)
    _rewrite_weights(path, lambda t: t.update({key: torch.zeros(shape)}))
    message = f"weight '{key}' has shape {shape} in the checkpoint, model expects {expected}"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(str(path))


def test_value_heads_must_be_a_multiple_of_key_heads(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("qwen3_next"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["linear_num_value_heads"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        load_checkpoint(str(path))
