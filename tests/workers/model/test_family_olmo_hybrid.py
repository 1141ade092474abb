"""OLMo-Hybrid (`olmo_hybrid`): exact against transformers' own modeling code, every checkpoint layout, state
continuation, named errors for missing or mis-shaped tensors, and the decode plan's reason for declining it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import OlmoHybridForCausalLM

from pipeline.preflight import check_model
from tests.workers.model.olmo_hybrid_fixtures import build_olmo_hybrid
from tests.workers.model.test_state_continuation import (  # noqa: F401  (collected here on the OLMo fixture)
    test_extend_equals_single_steps,
    test_prefill_from_a_state_equals_one_full_prefill,
    test_ragged_batch_rows_equal_rows_run_alone,
)
from tests.workers.test_oracle import assert_same_greedy
from workers import ModelRunner, SamplingParams
from workers.model import HybridConfig, load_checkpoint
from workers.model.steps.decode_plan import unsupported_reason

LAYOUTS = ["olmo_hybrid", "olmo_hybrid_rope"]  # NoPE + beta in (0, 2) (as released); RoPE + beta in (0, 1)
SCORE_LENGTHS = [2, 9, 16, 33, 64, 65, 70, 5]  # around and across the delta rule's chunk (64)


@pytest.fixture(scope="module")
def olmo_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: build_olmo_hybrid(name, tmp_path_factory.mktemp(name)) for name in LAYOUTS}


@pytest.fixture(scope="module")
def loaded(olmo_dirs):
    """The released layout, for the state-continuation tests imported above."""
    return load_checkpoint(str(olmo_dirs["olmo_hybrid"]))


def _sequences(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=generator).tolist() for n in lengths]


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / "model"))


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


RELEASED_7B = {  # allenai/Olmo-Hybrid-7B as OLMo-core's converter writes it: no RoPE, linear head dims left to defaults
    "model_type": "olmo_hybrid", "vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008,
    "num_hidden_layers": 8, "num_attention_heads": 30, "num_key_value_heads": 30, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 30, "linear_num_value_heads": 30, "linear_conv_kernel_dim": 4,
    "linear_allow_neg_eigval": True, "rope_theta": None, "eos_token_id": 100257,
}  # fmt: skip


def test_config_reader_follows_olmo_hybrid_config_defaults():
    config = HybridConfig.from_hf_dict(RELEASED_7B)
    g, a = config.gdn, config.attention
    assert (g.key_head_dim, g.value_head_dim, g.beta_scale, g.norm_eps) == (96, 192, 2.0, 1e-5)
    assert a.rope_theta is None and a.qk_norm_full_width and a.head_dim == 128 and not a.output_gate
    assert config.block_kinds[:8] == ("gdn", "mlp") * 3 + ("attention", "mlp")  # full attention every 4th layer
    assert config.post_norm_blocks == (6, 7, 14, 15)
    assert config.max_position_embeddings == 65536 and not config.tie_word_embeddings
    rope = HybridConfig.from_hf_dict({**RELEASED_7B, "linear_allow_neg_eigval": False, "rope_theta": 500000})
    assert rope.attention.rope_theta == 500000.0 and rope.gdn.beta_scale == 1.0
    assert HybridConfig.from_hf_dict({k: v for k, v in RELEASED_7B.items() if k != "rope_theta"}).attention.rope_theta
    yarn = {**RELEASED_7B, "rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 8.0}}
    with pytest.raises(ValueError, match="unsupported olmo_hybrid rope_type 'yarn'"):
        HybridConfig.from_hf_dict(yarn)
    with pytest.raises(ValueError, match="needs both 'linear_attention' and 'full_attention'"):
        HybridConfig.from_hf_dict({**RELEASED_7B, "layer_types": ["full_attention"] * 8})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_match_transformers_in_float64(layout, olmo_dirs):
    """Ours (float32) against transformers in float64: transformers' own float32 run strays up to ~1e-4 from its
    float64 one on this model (measured), so the float64 run is the oracle."""
    path = olmo_dirs[layout]
    hf = OlmoHybridForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    sequences = _sequences(1, SCORE_LENGTHS)
    scores = ModelRunner.from_pretrained(str(path), max_num_seqs=4).score(sequences)  # ragged batches of 4
    worst = 0.0
    for sequence, score in zip(sequences, scores):
        ids = torch.tensor([sequence])
        with torch.no_grad():
            logprobs = hf(ids, position_ids=torch.arange(len(sequence))[None]).logits.log_softmax(-1)
        reference = logprobs[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        worst = max(worst, (torch.tensor(score.token_logprobs, dtype=torch.float64) - reference).abs().max().item())
    print(f"{layout}: max |Δ logprob| = {worst:.2e}")
    assert worst < 1e-4
    assert torch.tensor(scores[3].token_logprobs).std() > 0.3  # far from uniform: the input matters


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generation_matches_transformers(layout, olmo_dirs):
    """Token for token (a top-2 near-tie may flip), ragged prompts through fewer slots than prompts."""
    path = olmo_dirs[layout]
    hf = OlmoHybridForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _sequences(2, [1, 17, 40])
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=2)
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        assert_same_greedy(result.token_ids, out.sequences[0, len(prompt) :].tolist(), margins)


def test_hub_key_layout_loads_the_same_model(olmo_dirs, tmp_path):
    """OLMo-core's names (`attention_layer_norm`, `feedforward_layer_norm`, `q/k/v_conv1d` of q / k / v widths) and
    a fused `conv1d` load exactly the model transformers' own save does."""
    hub = build_olmo_hybrid("olmo_hybrid", tmp_path / "hub", hub_layout=True)
    keys = load_file(hub / "model.safetensors")
    assert keys["model.layers.0.linear_attn.v_conv1d.weight"].shape == (96, 1, 4)
    assert "model.layers.0.attention_layer_norm.weight" in keys
    assert "model.layers.2.post_attention_layernorm.weight" in keys
    fused = _copy(olmo_dirs["olmo_hybrid"], tmp_path)

    def fuse(tensors):
        for layer in (0, 1, 3):
            prefix = f"model.layers.{layer}.linear_attn"
            convs = [tensors.pop(f"{prefix}.{p}_conv1d.weight") for p in "qkv"]
            tensors[f"{prefix}.conv1d.weight"] = torch.cat(convs)

    _rewrite(fused, fuse)
    sequences = _sequences(3, [12, 40])
    reference = ModelRunner.from_pretrained(str(olmo_dirs["olmo_hybrid"])).score(sequences)
    for path in (hub, fused):
        scores = ModelRunner.from_pretrained(str(path)).score(sequences)
        assert [s.token_logprobs for s in scores] == [s.token_logprobs for s in reference]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.linear_attn.g_proj.weight"),
            "missing weight ['model.layers.1.linear_attn.g_proj.weight']",
        ),
        (
            lambda t: t.pop("model.layers.2.post_feedforward_layernorm.weight"),
            "missing weight ['model.layers.2.post_feedforward_layernorm.weight']",
        ),
        (
            lambda t: t.update({"model.layers.0.linear_attn.b_proj.weight": torch.zeros(2, 64)}),
            "weight 'model.layers.0.linear_attn.b_proj.weight' has shape (2, 64) in the checkpoint, model expects (4, 64)",
        ),
        (
            lambda t: t.update({"model.layers.2.self_attn.q_norm.weight": torch.zeros(16)}),
            "weight 'model.layers.2.self_attn.q_norm.weight' has shape (16,) in the checkpoint, model expects (64,)",
        ),
        (
            lambda t: t.update({"model.layers.3.linear_attn.v_conv1d.weight": torch.zeros(20, 1, 3)}),
            "concatenated they must give (160, 1, 4)",
        ),
    ],
)
def test_preflight_names_missing_and_misshaped_tensors(edit, message, olmo_dirs, tmp_path):
    path = _copy(olmo_dirs["olmo_hybrid"], tmp_path)
    _rewrite(path, edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_model(str(path))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(str(path))


def test_value_heads_must_be_a_multiple_of_key_heads(olmo_dirs, tmp_path):
    path = _copy(olmo_dirs["olmo_hybrid"], tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "linear_num_value_heads": 3}))
    with pytest.raises(ValueError, match="linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        check_model(str(path))


def test_decode_plan_covers_olmo_hybrid(loaded):
    """The native decode plan covers OLMo-Hybrid (post-norm blocks, whole-width q/k norms, beta = 2·sigmoid(b) in
    the native GDN kernels; tests/workers/model/test_decode_plan_lfm_olmo.py checks it against the module path)."""
    assert unsupported_reason(loaded.model) is None
    mixers = [block.mixer for block in loaded.model.blocks if block.kind == "gdn"]
    assert mixers and all(mixer.decode_kernel == "native" for mixer in mixers)


def test_graph_steps_generate_what_the_module_path_does(olmo_dirs):
    """The CUDA-graph step functions (run eagerly on a CPU) handle the post-norm blocks and beta · 2 as the module
    path does: greedy output equal, 4 prompts through 3 slots."""
    from tests.workers.model.test_cuda_graph import PARAMS, PROMPTS, _generate

    path = str(olmo_dirs["olmo_hybrid"])
    expected = _generate(path, PROMPTS, PARAMS, decode_plan=False, cuda_graphs=False)
    assert _generate(path, PROMPTS, PARAMS, cuda_graphs=True) == expected
