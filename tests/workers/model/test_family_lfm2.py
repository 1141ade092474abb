"""LFM2, LFM2-MoE and LFM3 against transformers' own modeling code, state continuation, config spellings of the
published checkpoints, and preflight errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

from pipeline.preflight import check_model
from tests.lfm_models import LFM_FAMILIES, lfm_checkpoint  # noqa: F401 (a fixture)
from tests.workers.model.test_state_continuation import (  # noqa: F401 (run here over the LFM checkpoints)
    test_extend_equals_single_steps,
    test_prefill_from_a_state_equals_one_full_prefill,
    test_ragged_batch_rows_equal_rows_run_alone,
)
from tests.workers.test_oracle import _hf_greedy, _hf_logprobs, _prompts, assert_same_greedy
from workers import ModelRunner, SamplingParams
from workers.model import HybridConfig, load_checkpoint
from workers.model.checkpoint.config import ATTENTION, MLP, MOE, SHORT_CONV

FAMILIES = sorted(LFM_FAMILIES)


@pytest.fixture(scope="module")
def hf_lfm(lfm_checkpoint):  # noqa: F811
    """LFM family → transformers' own model loaded from its tiny checkpoint (the oracle), cached."""
    import transformers

    cache: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in cache:
            path = lfm_checkpoint(family)
            architecture = transformers.AutoConfig.from_pretrained(path).architectures[0]
            cache[family] = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
        return cache[family]

    return get


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, lfm_checkpoint):  # noqa: F811
    """The state-continuation tests' model, for each LFM family."""
    return load_checkpoint(str(lfm_checkpoint(request.param)))


@pytest.mark.parametrize("family", FAMILIES)
def test_score_matches_transformers(family, lfm_checkpoint, hf_lfm):  # noqa: F811
    runner = ModelRunner.from_pretrained(str(lfm_checkpoint(family)), max_num_seqs=4)
    sequences = _prompts(1, [2, 9, 16, 33, 48, 5])  # past LFM3's window of 8 and around the conv's 3-7 taps
    scores = runner.score(sequences)
    worst = 0.0
    for seq, score in zip(sequences, scores):
        assert score.error is None
        reference = _hf_logprobs(hf_lfm(family), seq)
        worst = max(worst, (torch.tensor(score.token_logprobs) - reference).abs().max().item())
    print(f"{family}: max |Δ logprob| = {worst:.2e}")
    assert worst < 1e-4
    assert torch.tensor(scores[3].token_logprobs).std() > 0.3  # far from uniform: the input matters


@pytest.mark.parametrize("family", ["lfm2", "lfm2_moe", "lfm3"])
def test_greedy_generate_matches_transformers(family, lfm_checkpoint, hf_lfm):  # noqa: F811
    runner = ModelRunner.from_pretrained(str(lfm_checkpoint(family)), max_num_seqs=3)  # ragged, slots reused
    prompts = _prompts(2, [1, 8, 29, 40])
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and result.error is None
        reference, margins = _hf_greedy(hf_lfm(family), prompt, 8)
        assert_same_greedy(result.token_ids, reference, margins)


def _hub_lfm2(hidden: int, layers: int, ff: int, attention: list[int], **extra) -> dict:
    """An LFM2 config.json as the hub's LFM2 checkpoints spell it (both `full_attn_idxs` and `layer_types`,
    `block_ff_dim`, `tie_embedding`, top-level `rope_theta`)."""
    layer_types = ["full_attention" if i in attention else "conv" for i in range(layers)]
    return {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "vocab_size": 65536,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "block_ff_dim": ff,
        "intermediate_size": ff,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "full_attn_idxs": attention,
        "layer_types": layer_types,
        "conv_L_cache": 3,
        "conv_bias": False,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_embedding": True,
        **extra,
    }


@pytest.mark.parametrize(
    "raw",
    [
        _hub_lfm2(2048, 16, 12288, [2, 5, 8, 10, 12, 14]),  # LFM2-1.2B
        _hub_lfm2(1024, 16, 6656, [2, 5, 8, 10, 12, 14]),  # LFM2-350M
        _hub_lfm2(2048, 30, 10752, [2, 6, 10, 14, 18, 22, 26], block_ffn_dim_multiplier=1.5),  # a multiplier
        {k: v for k, v in _hub_lfm2(1536, 16, 10240, [2, 5, 8]).items() if k != "layer_types"},  # indices only
    ],
)
def test_hub_lfm2_configs_match_transformers_shapes(raw):
    config = HybridConfig.from_hf_dict(raw)
    reference = Lfm2Config(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        mlp = Lfm2MLP(reference)
    assert config.feed_forward.intermediate_size == mlp.w1.out_features
    expected = [SHORT_CONV if t == "conv" else ATTENTION for t in reference.layer_types]
    assert list(config.block_kinds[::2]) == expected and set(config.block_kinds[1::2]) == {MLP}
    assert config.tie_word_embeddings and config.short_conv.conv_kernel == 3
    assert config.attention.rope_theta == 1e6 and config.attention.head_dim == raw["hidden_size"] // 32


def test_hub_lfm2_moe_config_reads_dense_first_layers():
    layer_types = ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv"]
    raw = {"model_type": "lfm2_moe", "vocab_size": 65536, "hidden_size": 2048, "num_hidden_layers": 8,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 7168, "moe_intermediate_size": 1792,
           "num_dense_layers": 2, "num_experts": 32, "num_experts_per_tok": 4, "use_expert_bias": True,
           "layer_types": layer_types, "conv_L_cache": 3, "norm_eps": 1e-5}  # fmt: skip
    config = HybridConfig.from_hf_dict(raw)
    assert config.block_kinds[1::2] == (MLP, MLP, MOE, MOE, MOE, MOE, MOE, MOE)
    ff = config.feed_forward
    assert (ff.intermediate_size, ff.expert_intermediate_size, ff.num_experts, ff.experts_per_token) == (
        7168,
        1792,
        32,
        4,
    )
    with pytest.raises(ValueError, match="unknown lfm2_moe layer types \\['mamba'\\]"):
        HybridConfig.from_hf_dict({**raw, "layer_types": ["mamba"] * 8})


@pytest.mark.parametrize(
    "family, key, change, message",
    [
        ("lfm2", "model.layers.2.conv.conv.weight", "drop", "missing weight \\['model.layers.2.conv.conv.weight'\\]"),
        (
            "lfm2",
            "model.layers.0.conv.conv.weight",
            "reshape",
            "model.layers.0.conv.conv.weight' has shape \\(64, 1, 2\\)",
        ),
        ("lfm2_moe", "model.layers.3.feed_forward.experts.1.w2.weight", "drop", "experts.1.w2.weight"),
        ("lfm3", "model.layers.4.self_attn.gate_proj.weight", "drop", "self_attn.g_proj.weight"),
    ],
)
def test_preflight_names_missing_and_misshaped_tensors(family, key, change, message, lfm_checkpoint, tmp_path):  # noqa: F811
    model = shutil.copytree(lfm_checkpoint(family), tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    if change == "drop":
        del tensors[key]
    else:
        tensors[key] = tensors[key][..., :2].contiguous()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        check_model(str(model))
    json.loads((model / "config.json").read_text())  # the config itself is untouched


def test_fused_experts_load_like_per_expert_ones(lfm_checkpoint, tmp_path):  # noqa: F811
    """transformers 5's in-memory layout (`experts.gate_up_proj [E, 2I, d]`, `experts.down_proj [E, d, I]`) and the
    hub's per-expert `experts.E.{w1, w3, w2}` load into the same model."""
    source = lfm_checkpoint("lfm2_moe")
    model = shutil.copytree(source, tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    for prefix in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        pop = lambda e, w: tensors.pop(f"{prefix}.experts.{e}.{w}.weight")  # noqa: E731
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([pop(e, "w1"), pop(e, "w3")]) for e in range(8)]
        )
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([pop(e, "w2") for e in range(8)])
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    fused, per_expert = load_checkpoint(str(model)).model, load_checkpoint(str(source)).model
    for ours, theirs in zip(fused.parameters(), per_expert.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_graph_plan_steps_equal_the_module_path_and_are_capture_safe(lfm_checkpoint):  # noqa: F811
    """The CUDA graph plan's static-shape steps (LFM3: conv windows shifted without host reads, sliding windows
    masked over the whole capacity, proportional RoPE), in their eager form, against the module path; and
    capture-safe."""
    family = "lfm3"
    from tests.workers.model import test_cuda_graph

    def checkpoint_dir(_: str):
        return lfm_checkpoint(family)

    test_cuda_graph.test_graph_steps_equal_the_module_path(checkpoint_dir, family)
    test_cuda_graph.test_every_captured_step_is_capture_safe(checkpoint_dir, family)
