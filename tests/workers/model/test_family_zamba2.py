"""Zamba2 against transformers' own modeling code, its state handling, its config and weight layouts, and preflight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Zamba2ForCausalLM

from pipeline.preflight import check_model
from tests.workers.model import test_state_continuation as continuation
from tests.workers.test_oracle import _hf_greedy, _hf_logprobs, _prompts, assert_same_greedy
from tests.zamba2_models import ZAMBA2_LAYOUTS, build_zamba2, copy_shared_weights_to_every_use
from workers import ModelRunner, SamplingParams
from workers.memory import kv_bytes_per_token
from workers.model import HybridConfig, StatePool, load_checkpoint
from workers.model.checkpoint.config import MAMBA, SHARED_ATTENTION
from workers.model.steps.decode_plan import unsupported_reason

LAYOUTS = sorted(ZAMBA2_LAYOUTS)


@pytest.fixture(scope="module")
def zamba2_dir(tmp_path_factory):
    """layout name → its tiny checkpoint directory (built on first use)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_zamba2(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="module")
def oracle(zamba2_dir):
    """layout name → transformers' Zamba2ForCausalLM loaded from its checkpoint (float32)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = Zamba2ForCausalLM.from_pretrained(zamba2_dir(name), dtype=torch.float32).eval()
        return cache[name]

    return get


@pytest.mark.parametrize("name", LAYOUTS)
def test_score_matches_transformers(name, zamba2_dir, oracle):
    runner = ModelRunner.from_pretrained(str(zamba2_dir(name)), max_num_seqs=4)
    sequences = _prompts(1, [2, 9, 16, 33, 48, 5])
    scores = runner.score(sequences)
    worst = 0.0
    for sequence, score in zip(sequences, scores):
        assert score.error is None
        reference = _hf_logprobs(oracle(name), sequence)
        worst = max(worst, (torch.tensor(score.token_logprobs) - reference).abs().max().item())
    print(f"{name}: max |Δ logprob| = {worst:.2e}")
    assert worst < 1e-4
    assert torch.tensor(scores[3].token_logprobs).std() > 0.3  # far from uniform: the input matters


def assert_greedy_of(hf, prompt: list[int], tokens: list[int]) -> None:
    """`tokens` are transformers' greedy continuation of `prompt`, checked in one forward over prompt + tokens
    (each token must be the argmax after the ones before it; a near-tie, top-2 margin < 1e-4, may flip and ends
    the check) — the same as comparing with `generate` token for token, at the cost of one forward."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = hf(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 :].float()
    for step, (token, row) in enumerate(zip(tokens, logits)):
        top = row.topk(2)
        if int(top.indices[0]) != token:
            margin = float(top.values[0] - top.values[1])
            assert margin < 1e-4, f"step {step}: ours {token}, transformers {int(top.indices[0])} ({margin:.2e})"
            return


@pytest.mark.parametrize("name", LAYOUTS)
def test_greedy_generate_matches_transformers(name, zamba2_dir, oracle):
    runner = ModelRunner.from_pretrained(str(zamba2_dir(name)), max_num_seqs=3)  # ragged batches, reused slots
    prompts = _prompts(2, [1, 3, 15, 17, 29, 40])
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and result.error is None and len(result.token_ids) == 10
        assert_greedy_of(oracle(name), prompt, result.token_ids)
    if name == "zamba2_lora":  # and once through transformers' own (cached, one token a step) decode path
        reference, margins = _hf_greedy(oracle(name), prompts[1], 10)
        assert_same_greedy(results[1].token_ids, reference, margins)


@pytest.fixture(scope="module", params=LAYOUTS)
def loaded(request, zamba2_dir):
    return load_checkpoint(str(zamba2_dir(request.param)))


def test_state_continuation(loaded):
    """Prefill from a kept state == one prefill; extend(n) == n single steps (KV of every use included); rows of a
    ragged batch == the rows run alone."""
    continuation.test_prefill_from_a_state_equals_one_full_prefill(loaded)
    continuation.test_extend_equals_single_steps(loaded)
    continuation.test_ragged_batch_rows_equal_rows_run_alone(loaded)


def test_every_use_has_its_own_kv_cache_and_shares_its_weights(loaded):
    config, model = loaded.config, loaded.model
    num_uses = config.block_kinds.count(SHARED_ATTENTION)
    pool = StatePool(config, 2, 32, torch.device("cpu"), torch.float32)
    assert pool.key.shape[0] == num_uses >= 3
    a = config.attention
    assert kv_bytes_per_token(config, torch.float32) == 2 * num_uses * a.num_kv_heads * a.head_dim * 4
    uses = [block.mixer for block in model.blocks if block.kind == SHARED_ATTENTION]
    assert uses[0].down_proj is uses[2].down_proj and uses[0].down_proj is not uses[1].down_proj  # round-robin
    assert uses[0].attention.o_proj is uses[2].attention.o_proj
    assert uses[0].linear is not uses[2].linear  # each use projects with its own linear
    assert unsupported_reason(model) is None  # decode steps run as a plan (test_decode_plan_zamba2.py)


def test_reads_published_config_spellings():
    """A Zamba2-2.7B-style hub config: legacy layer names, `hybrid_layer_ids`, `ffn_hidden_size`, tied embeddings
    left implicit, adapters on the MLP only; and the refusals."""
    pattern = ["mamba"] * 6 + ["hybrid", "mamba", "mamba", "hybrid"]
    raw = {"model_type": "zamba2", "vocab_size": 32000, "hidden_size": 2560, "layers_block_type": pattern,
           "hybrid_layer_ids": [6, 9], "num_attention_heads": 32, "n_mamba_heads": 80, "mamba_headdim": 64,
           "mamba_d_state": 64, "mamba_ngroups": 1, "ffn_hidden_size": 10240, "num_mem_blocks": 2,
           "use_shared_attention_adapter": False, "use_shared_mlp_adapter": True, "adapter_rank": 128,
           "use_mem_rope": False, "time_step_min": 0.001, "chunk_size": 256}  # fmt: skip
    config = HybridConfig.from_hf_dict(raw)
    assert config.block_kinds == (MAMBA,) * 6 + (SHARED_ATTENTION, MAMBA, MAMBA, MAMBA, SHARED_ATTENTION, MAMBA)
    assert config.tie_word_embeddings and config.attention.head_dim == 160 and config.attention.rope_theta is None
    assert config.attention.scale == pytest.approx(80**-0.5)
    assert (config.mamba.head_dim, config.mamba.dt_min, config.mamba.norm_eps) == (64, 0.001, 1e-5)
    shared = config.shared_block
    assert (shared.num_blocks, shared.intermediate_size, shared.mlp_adapters, shared.attention_adapters) == (
        2,
        10240,
        True,
        False,
    )
    refusals = {
        "hybrid_layer_ids": [{**raw, "hybrid_layer_ids": [6]}, "disagree"],
        "layer type": [{**raw, "layers_block_type": ["mamba", "moe"]}, "unknown zamba2 layer types"],
        "activation": [{**raw, "hidden_act": "relu"}, "hidden_act"],
        "long context": [{**raw, "use_mem_rope": True, "use_long_context": True}, "use_long_context"],
    }
    for bad, message in refusals.values():
        with pytest.raises(ValueError, match=message):
            HybridConfig.from_hf_dict(bad)


def test_weights_copied_under_every_use_load_the_same_model(zamba2_dir, tmp_path):
    path = Path(shutil.copytree(zamba2_dir("zamba2_lora"), tmp_path / "copies"))
    copy_shared_weights_to_every_use(path / "model.safetensors")
    ids = torch.tensor([_prompts(3, [20])[0]])
    first = ModelRunner.from_pretrained(str(zamba2_dir("zamba2_lora"))).score(ids.tolist())[0].token_logprobs
    assert ModelRunner.from_pretrained(str(path)).score(ids.tolist())[0].token_logprobs == first
    # Copies that disagree are refused when the weights are read.
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.4.shared_transformer.self_attn.q_proj.weight"] += 1.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="copies of a shared zamba2 weight differ"):
        load_checkpoint(str(path))


def test_preflight_names_missing_and_misshaped_tensors(zamba2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(zamba2_dir("zamba2_lora"), tmp_path / "broken"))
    tensors = load_file(path / "model.safetensors")
    adapter = "model.layers.0.shared_transformer.self_attn.linear_k_adapter_list.2.1.weight"  # use 2's, block 0
    del tensors[adapter]
    tensors["model.layers.2.linear.weight"] = tensors["model.layers.2.linear.weight"][:, :8].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        check_model(str(path))
    message = str(error.value)
    assert adapter in message and "missing" in message
    assert "model.layers.2.linear.weight" in message and "(64, 8)" in message
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "use_shared_attention_adapter": False}))
    with pytest.raises(ValueError, match="unexpected weight .*linear_q_adapter_list"):
        check_model(str(path))
