"""Kimi-Linear configs and checkpoints: the published 48B-A3B layout as its `config.json` spells it, refusals of what
is not implemented, and preflight naming missing or mis-shaped tensors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.preflight import check_model
from tests.kimi_models import build_kimi_checkpoint
from workers import ModelRunner
from workers.memory import kv_bytes_per_token, state_bytes_per_slot
from workers.model import load_checkpoint
from workers.model.checkpoint.config import ATTENTION, KDA, MLP, MOE, HybridConfig
from workers.model.kernels import native
from workers.model.steps.decode_plan import unsupported_reason

_FULL = [4, 8, 12, 16, 20, 24, 27]
# moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (hub spellings; remote-code fields left out).
PUBLISHED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2304, "intermediate_size": 9216, "kv_lora_rank": 512, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": _FULL, "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                           "kda_layers": [i for i in range(1, 28) if i not in _FULL]},
    "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256,
    "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32, "num_nextn_predict_layers": 0,
    "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_published_48b_layout():
    config = HybridConfig.from_hf_dict(PUBLISHED)
    mixers, ffs = config.block_kinds[::2], config.block_kinds[1::2]
    assert [i + 1 for i, kind in enumerate(mixers) if kind == ATTENTION] == _FULL
    assert set(mixers) == {KDA, ATTENTION} and ffs == (MLP,) + (MOE,) * 26
    assert (config.kda.num_heads, config.kda.head_dim, config.kda.conv_kernel) == (32, 128, 4)
    assert config.recurrent_state_shapes() == ((3 * 32 * 128, 3), (32, 128, 128))
    ff = config.feed_forward
    assert (ff.num_experts, ff.experts_per_token, ff.shared_expert_intermediate_size) == (256, 8, 1024)
    assert (ff.router, ff.routed_scaling_factor, ff.norm_topk_prob) == ("sigmoid", 2.446, True)
    assert config.max_position_embeddings == 1048576 and config.eos_token_ids == (163586,)
    # The KV cache per token: 7 latent-attention layers × one head [512 latent | 64 rope key], in bfloat16 —
    # 8,064 bytes, against 7 × 32 heads × (192 + 128) × 2 = 143,360 for expanded keys and values.
    assert kv_bytes_per_token(config, torch.bfloat16) == 7 * 576 * 2
    assert state_bytes_per_slot(config, torch.bfloat16) == 20 * (3 * 4096 * 3 * 2 + 4 * 32 * 128 * 128)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mla_use_nope": False}, "mla_use_nope=false"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func 'softmax'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_shared_experts": 0}, "without shared experts"),
        ({"linear_attn_config": {**PUBLISHED["linear_attn_config"], "kda_layers": [1, 2, 4]}}, "must split layers"),
        ({"linear_attn_config": {**PUBLISHED["linear_attn_config"], "gate_lower_bound": -5.0}}, "gate_lower_bound"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HybridConfig.from_hf_dict({**PUBLISHED, **change})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_kimi_checkpoint("kimi_linear", tmp_path_factory.mktemp("kimi_linear"))


def _broken(checkpoint, tmp_path, edit):
    path = shutil.copytree(checkpoint, tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize(
    ("key", "shape", "expected"),
    [
        ("model.layers.2.self_attn.kv_b_proj.weight", (100, 24), (4 * (16 + 12), 24)),
        ("model.layers.2.self_attn.kv_a_proj_with_mqa.weight", (24, 64), (24 + 8, 64)),
        ("model.layers.1.self_attn.A_log", (2,), (1, 1, 2, 1)),
        ("model.layers.3.self_attn.k_conv1d.weight", (32, 1, 3), (32, 1, 4)),
        ("model.layers.1.block_sparse_moe.experts.4.w3.weight", (16, 64), (32, 64)),
    ],
)
def test_preflight_names_misshaped_tensors(checkpoint, tmp_path, key, shape, expected):
    path = _broken(checkpoint, tmp_path, lambda t: t.update({key: torch.zeros(shape)}))
    message = f"weight '{key}' has shape {shape} in the checkpoint, model expects {expected}"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_model(str(path))


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.0.self_attn.v_conv1d.weight",
        "model.layers.0.self_attn.f_b_proj.weight",
        "model.layers.2.self_attn.kv_a_layernorm.weight",
        "model.layers.3.block_sparse_moe.experts.5.w2.weight",
    ],
)
def test_preflight_names_missing_tensors(checkpoint, tmp_path, key):
    path = _broken(checkpoint, tmp_path, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=re.escape(f"missing weight ['{key}'")):
        check_model(str(path))
    with pytest.raises(ValueError, match=re.escape(f"missing weight ['{key}'")):
        load_checkpoint(str(path))


def test_config_with_an_unsupported_feature_fails_preflight(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["moe_router_activation_func"] = "softmax"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="moe_router_activation_func 'softmax'"):
        check_model(str(path))


def test_decode_plan_covers_kimi_linear_where_the_native_kernels_run(checkpoint):
    reason = unsupported_reason(load_checkpoint(str(checkpoint)).model)
    if native.available():
        assert reason is None  # KDA, latent attention and the MoE blocks all record native kernels
    else:
        assert "native kernels are off" in reason
    assert "native kernels are off" in unsupported_reason(load_checkpoint(str(checkpoint), decode_kernel="torch").model)


def test_bfloat16_weights_run_close_to_float32(checkpoint):
    """The float32-kept parameters (A_log, dt_bias, score bias) and the float32 recurrences survive bfloat16."""
    sequence = [[5, 9, 12, 7, 30, 31, 4, 99, 100, 17, 3, 40, 41, 40, 41]]
    scores = [ModelRunner.from_pretrained(str(checkpoint), dtype=d).score(sequence)[0] for d in ("float32", "bfloat16")]
    assert (torch.tensor(scores[0].token_logprobs) - torch.tensor(scores[1].token_logprobs)).abs().max() < 0.25
