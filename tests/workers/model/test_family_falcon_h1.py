"""Falcon-H1 (parallel Mamba2 + attention, μP multipliers) against transformers' own `FalconH1ForCausalLM`, state
continuation, the published configs' layouts and preflight errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.preflight import check_model
from tests.falcon_h1_models import FALCON_H1_FAMILIES, build_falcon_h1
from tests.workers.model.test_state_continuation import _assert_states_close, _run, _tokens
from tests.workers.test_oracle import _hf_greedy, _hf_logprobs, _prompts, assert_same_greedy
from workers import ModelRunner, SamplingParams
from workers.model import StatePool, load_checkpoint
from workers.model.checkpoint.config import MLP, PARALLEL, HybridConfig

VARIANTS = sorted(FALCON_H1_FAMILIES)
TOL = dict(atol=5e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def falcon_dir(tmp_path_factory):
    """variant → its tiny checkpoint directory (built once per module)."""
    return {name: build_falcon_h1(name, tmp_path_factory.mktemp(name)) for name in VARIANTS}


@pytest.fixture(scope="module")
def hf(falcon_dir):
    """variant → transformers' FalconH1ForCausalLM from the same directory (the oracle)."""
    from transformers import FalconH1ForCausalLM

    return {
        name: FalconH1ForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for name, path in falcon_dir.items()
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_score_and_greedy_match_transformers(variant, falcon_dir, hf):
    runner = ModelRunner.from_pretrained(str(falcon_dir[variant]), max_num_seqs=3)  # 5 prompts through 3 slots
    sequences = _prompts(1, [2, 16, 33, 48, 9])
    worst = 0.0
    for seq, score in zip(sequences, runner.score(sequences)):
        assert score.error is None
        worst = max(worst, (torch.tensor(score.token_logprobs) - _hf_logprobs(hf[variant], seq)).abs().max().item())
    print(f"{variant}: max |Δ logprob| = {worst:.2e}")
    assert worst < 1e-4
    assert torch.tensor(score.token_logprobs).std() > 0.3  # far from uniform: the model reads its input
    prompts = _prompts(2, [1, 17, 40])  # ragged, across the SSD chunk size (16)
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        reference, margins = _hf_greedy(hf[variant], prompt, 6)
        assert_same_greedy(result.token_ids, reference, margins)


@pytest.mark.parametrize("variant", ["falcon_h1", "falcon_h1_no_norm"])
def test_state_continuation_and_ragged_rows(variant, falcon_dir):
    """Prefill from a kept state == one prefill of the whole; k single steps == one k-token extend; rows of a
    ragged batch == the rows run alone (recurrent states and KV caches alike)."""
    loaded = load_checkpoint(str(falcon_dir[variant]))
    model, config = loaded.model, loaded.config
    tokens = _tokens(37)
    full = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    full_hidden, full_states = _run(model, full, tokens, [0], [0], [37], full.zeros(1))
    pool = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    _, states = _run(model, pool, tokens[:, :20], [0], [0], [20], pool.zeros(1))
    extended, extended_states = _run(model, pool, tokens[:, 20:28], [0], [20], [8], states)
    for t in range(20, 28):  # the same 8 tokens one by one from the same state
        step, states = _run(model, pool, tokens[:, t : t + 1], [0], [t], [1], states)
        torch.testing.assert_close(step, extended[:, t - 20 : t - 19], **TOL)
    _assert_states_close(extended_states, states)
    hidden, states = _run(model, pool, tokens[:, 28:], [0], [28], [9], states)
    torch.testing.assert_close(hidden, full_hidden[:, 28:], **TOL)
    _assert_states_close(states, full_states)
    torch.testing.assert_close(pool.slot_kv(0, 37)[0], full.slot_kv(0, 37)[0], **TOL)
    lengths, slots = [5, 33, 1, 17], [5, 0, 3, 1]
    rows = [_tokens(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    padded = torch.full((4, max(lengths)), 7)  # padding with real token ids: they must not leak anywhere
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    pool = StatePool(config, 6, 64, torch.device("cpu"), torch.float32)
    hidden, states = _run(model, pool, padded, slots, [0] * 4, lengths, pool.zeros(4))
    for i, row in enumerate(rows):
        alone_pool = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
        alone, alone_states = _run(model, alone_pool, row[None], [0], [0], [len(row)], alone_pool.zeros(1))
        torch.testing.assert_close(hidden[i : i + 1, : len(row)], alone, **TOL)
        _assert_states_close([type(s)(s.conv[i : i + 1], s.ssm[i : i + 1]) for s in states], alone_states)
        torch.testing.assert_close(pool.slot_kv(slots[i], len(row))[0], alone_pool.slot_kv(0, len(row))[0], **TOL)


# The published checkpoints' config.json fields that set shapes and variants (TII's hub configs).
PUBLISHED = {
    "Falcon-H1-0.5B": dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           intermediate_size=2048, num_hidden_layers=36, mamba_d_ssm=1536, mamba_n_heads=24,
                           mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_rms_norm=False,
                           mamba_norm_before_gate=False, tie_word_embeddings=False, vocab_size=32784,
                           ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                           mlp_multipliers=[0.8838834764831844, 0.5859375], lm_head_multiplier=0.0390625),
    "Falcon-H1-7B": dict(hidden_size=3072, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         intermediate_size=12288, num_hidden_layers=44, mamba_d_ssm=3072, mamba_n_heads=24,
                         mamba_d_head=128, mamba_d_state=256, mamba_n_groups=1, mamba_rms_norm=True,
                         mamba_norm_before_gate=False, tie_word_embeddings=False, vocab_size=130049,
                         rope_theta=1e11, lm_head_multiplier=0.013020833333333334),
    "Falcon-H1-Tiny-90M": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                               intermediate_size=768, num_hidden_layers=24, mamba_d_ssm=768, mamba_n_heads=24,
                               mamba_d_head=32, mamba_d_state=64, mamba_n_groups=1, tie_word_embeddings=True,
                               vocab_size=32768),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_layouts_read(name):
    raw = {"model_type": "falcon_h1", "mamba_d_conv": 4, "mamba_chunk_size": 128, **PUBLISHED[name]}
    config = HybridConfig.from_hf_dict(raw)
    assert config.block_kinds == (PARALLEL, MLP) * raw["num_hidden_layers"]
    assert (config.mamba.num_heads, config.mamba.head_dim) == (raw["mamba_n_heads"], raw["mamba_d_head"])
    assert config.mamba.intermediate_size == raw["mamba_d_ssm"]
    assert config.attention.head_dim == raw["head_dim"]
    assert config.mamba.rms_norm == raw.get("mamba_rms_norm", False)
    assert config.logits_divisor == pytest.approx(1 / raw.get("lm_head_multiplier", 1.0))
    conv, state = config.recurrent_state_shapes()
    m = raw["mamba_d_ssm"] + 2 * raw["mamba_n_groups"] * raw["mamba_d_state"]
    assert conv == (m, 3) and state == (raw["mamba_n_heads"], raw["mamba_d_head"], raw["mamba_d_state"])


def test_bad_configs_are_named():
    raw = {"model_type": "falcon_h1", **PUBLISHED["Falcon-H1-Tiny-90M"]}
    with pytest.raises(ValueError, match=r"mamba_n_heads \(24\) × mamba_d_head \(30\) must equal mamba_d_ssm"):
        HybridConfig.from_hf_dict({**raw, "mamba_d_head": 30})
    with pytest.raises(ValueError, match="ssm_multipliers needs 5 values"):
        HybridConfig.from_hf_dict({**raw, "ssm_multipliers": [1.0, 1.0]})


def test_preflight_names_missing_and_misshaped_tensors(falcon_dir, tmp_path):
    check_model(str(falcon_dir["falcon_h1_biases"]))  # the untouched checkpoint passes
    path = shutil.copytree(falcon_dir["falcon_h1_biases"], tmp_path / "broken")
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.feed_forward.up_proj.weight")
    tensors.pop("model.layers.2.mamba.norm.weight")
    tensors["model.layers.0.mamba.in_proj.weight"] = torch.zeros(100, 64)
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        check_model(str(path))
    message = str(error.value)
    assert "missing weight ['model.layers.1.feed_forward.up_proj.weight']" in message
    assert "missing weight ['model.layers.2.mamba.norm.weight']" in message
    assert (
        "'model.layers.0.mamba.in_proj.weight' has shape (100, 64) in the checkpoint, model expects (196, 64)"
        in message
    )
    assert "'model.layers.0.self_attn.k_proj.bias' has shape (8,) in the checkpoint, model expects (16,)" in message
