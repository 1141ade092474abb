"""Jamba (Mamba1 + attention + MoE): config layouts of the published checkpoints, the selective scan against a
token-by-token reference, exactness against transformers (float64 oracle), state continuation, loading, preflight."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.preflight import check_model
from tests.tiny_jamba import JAMBA_FAMILIES, build_jamba_checkpoint, load_oracle
from tests.workers import test_oracle as oracle
from tests.workers.model import test_cuda_graph as graphs
from tests.workers.model import test_state_continuation as continuation
from workers import ModelRunner, SamplingParams
from workers.model import HybridConfig, load_checkpoint
from workers.model.checkpoint.config import ATTENTION, MAMBA1, MLP, MOE
from workers.model.kernels.selective_scan import selective_scan, selective_state_after, selective_step
from workers.model.steps.decode_plan import unsupported_reason

LAYOUTS = sorted(JAMBA_FAMILIES)
# Jamba-v0.1's config.json (AI21-Jamba-1.5-Mini and Jamba2-Mini share its layout), with its legacy fields.
JAMBA_V01 = dict(
    model_type="jamba",
    vocab_size=65536,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    attn_layer_period=8,
    attn_layer_offset=4,
    expert_layer_period=2,
    expert_layer_offset=1,
    num_experts=16,
    num_experts_per_tok=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=256,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    use_mamba_kernels=True,
    n_ctx=262144,
    calc_logits_for_entire_prompt=False,
    mamba_inner_layernorms=True,
    sliding_window=None,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory):
    """layout name → its tiny checkpoint directory (built once per module)."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_jamba_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="module", params=LAYOUTS)
def loaded(request, jamba_dir):
    return load_checkpoint(str(jamba_dir(request.param)))


def test_published_layouts_are_read_as_transformers_builds_them():
    v01 = HybridConfig.from_hf_dict(JAMBA_V01)
    mixers, feed_forwards = v01.block_kinds[0::2], v01.block_kinds[1::2]
    assert [i for i, kind in enumerate(mixers) if kind == ATTENTION] == [4, 12, 20, 28]
    assert set(mixers) == {ATTENTION, MAMBA1} and v01.recurrent_kind == MAMBA1
    assert [i for i, kind in enumerate(feed_forwards) if kind == MOE] == list(range(1, 32, 2))
    assert (v01.feed_forward.num_experts, v01.feed_forward.experts_per_token) == (16, 2)
    assert v01.max_position_embeddings == 262144 and v01.attention.rope_theta is None
    assert v01.recurrent_state_shapes() == ((8192, 3), (8192, 16))
    large = HybridConfig.from_hf_dict(
        {**JAMBA_V01, "hidden_size": 8192, "num_hidden_layers": 72, "num_attention_heads": 64, "mamba_dt_rank": "auto"}
    )
    assert large.mamba1.dt_rank == 512 and large.block_kinds.count(ATTENTION) == 9
    # Jamba Reasoning 3B: one expert (dense MLPs only), MQA, tied embeddings, attention at layers 7 and 21.
    reasoning = HybridConfig.from_hf_dict(
        {
            **JAMBA_V01,
            "hidden_size": 2560,
            "num_hidden_layers": 28,
            "num_attention_heads": 20,
            "num_key_value_heads": 1,
            "attn_layer_period": 14,
            "attn_layer_offset": 7,
            "num_experts": 1,
            "num_experts_per_tok": 1,
            "mamba_dt_rank": "auto",
            "tie_word_embeddings": True,
        }
    )
    assert [i for i, kind in enumerate(reasoning.block_kinds[0::2]) if kind == ATTENTION] == [7, 21]
    assert set(reasoning.block_kinds[1::2]) == {MLP} and reasoning.feed_forward.num_experts == 0
    assert reasoning.mamba1.dt_rank == math.ceil(2560 / 16) and reasoning.attention.num_kv_heads == 1
    assert reasoning.tie_word_embeddings


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_layer_offset": 8}, "attn_layer_offset"),
        ({"expert_layer_offset": 2}, "expert_layer_offset"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layers_block_type": ["mamba"] * 32}, "disagree"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        HybridConfig.from_hf_dict({**JAMBA_V01, **change})


def _reference_scan(x, dt, A, B, C, state):
    """The recurrence token by token, as transformers' slow path writes it."""
    ys = []
    for t in range(x.shape[1]):
        state = torch.exp(A[None] * dt[:, t, :, None]) * state + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((state * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_selective_scan_matches_the_token_by_token_recurrence(chunk):
    g = torch.Generator().manual_seed(0)
    b, length, channels, size = 3, 11, 5, 4
    x, C = torch.randn(b, length, channels, generator=g), torch.randn(b, length, size, generator=g)
    B = torch.randn(b, length, size, generator=g)
    dt = torch.rand(b, length, channels, generator=g) * torch.tensor([11, 4, 0])[:, None, None].gt(
        torch.arange(length)[None, :, None]
    )  # rows of 11, 4 and 0 valid tokens: dt 0 at padding
    A = -torch.exp(torch.randn(channels, size, generator=g))
    start = torch.randn(b, channels, size, generator=g)
    y, final = selective_scan(x.double(), dt.double(), A.double(), B.double(), C.double(), start.double(), chunk)
    y_ref, final_ref = _reference_scan(x.double(), dt.double(), A.double(), B.double(), C.double(), start.double())
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final[2], start[2].double())  # a row without tokens keeps its state
    # The state after a prefix (speculative shifting) is the scan's state there; one step is one scan position.
    after = selective_state_after(x[:, :6], dt[:, :6], A, B[:, :6], start)
    torch.testing.assert_close(after, selective_scan(x[:, :6], dt[:, :6], A, B[:, :6], C[:, :6], start)[1])
    y1, state1 = selective_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], start)
    torch.testing.assert_close(y1, y_ref[:, 0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state1, _reference_scan(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], start)[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_score_matches_transformers_in_float64(layout, jamba_dir):
    path = jamba_dir(layout)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=4)
    sequences = oracle._prompts(1, [2, 9, 16, 33, 48, 70])
    hf = load_oracle(path)
    worst = 0.0
    for seq, score in zip(sequences, runner.score(sequences)):
        assert score.error is None
        reference = oracle._hf_logprobs(hf, seq).double()
        worst = max(worst, (torch.tensor(score.token_logprobs, dtype=torch.float64) - reference).abs().max().item())
    print(f"{layout}: max |Δ logprob| vs transformers float64 = {worst:.2e}")
    assert worst < 1e-4
    assert torch.tensor(runner.score(sequences[3:4])[0].token_logprobs).std() > 0.3  # far from uniform


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generate_matches_transformers(layout, jamba_dir):
    path = jamba_dir(layout)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=3)  # ragged prompts through 3 slots, one reused
    prompts = oracle._prompts(2, [1, 8, 17, 40])
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    hf = load_oracle(path, torch.float32)
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and result.error is None
        reference, margins = oracle._hf_greedy(hf, prompt, 10)
        oracle.assert_same_greedy(result.token_ids, reference, margins)


def test_prefill_from_a_state_equals_one_full_prefill(loaded):
    continuation.test_prefill_from_a_state_equals_one_full_prefill(loaded)


def test_extend_equals_single_steps(loaded):
    continuation.test_extend_equals_single_steps(loaded)


def test_ragged_batch_rows_equal_rows_run_alone(loaded):
    continuation.test_ragged_batch_rows_equal_rows_run_alone(loaded)


def test_fused_experts_load_like_per_expert_ones(jamba_dir, tmp_path):
    per_expert = load_checkpoint(str(jamba_dir("jamba_moe"))).model
    fused = load_checkpoint(str(build_jamba_checkpoint("jamba_moe", tmp_path, fused_experts=True))).model
    for (name, a), (_, b) in zip(per_expert.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_decode_plan_covers_jamba_and_the_torch_kernel_says_why_not(loaded, jamba_dir):
    assert unsupported_reason(loaded.model) is None
    torch_model = load_checkpoint(str(jamba_dir("jamba_dense")), decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_model)
    mixed = load_checkpoint(str(jamba_dir("jamba_dense"))).model
    next(block for block in mixed.blocks if block.kind == MAMBA1).mixer.decode_kernel = "torch"
    assert unsupported_reason(mixed) == "Mamba1 decode steps do not run through the native kernel"


def _dirs(jamba_dir, checkpoint_dir):
    """The shared tests' `checkpoint_dir`, with the Jamba layouts added."""
    return lambda name: jamba_dir(name) if name in JAMBA_FAMILIES else checkpoint_dir(name)


def test_cuda_graph_steps_equal_the_module_path(jamba_dir, checkpoint_dir):
    """The graph plan's static steps (in their eager form) on the MoE-free layout, which CUDA runs as graphs."""
    graphs.test_graph_steps_equal_the_module_path(_dirs(jamba_dir, checkpoint_dir), "jamba_dense")
    graphs.test_every_captured_step_is_capture_safe(_dirs(jamba_dir, checkpoint_dir), "jamba_dense")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_with_graphs_equals_plain_module_decoding(jamba_dir, checkpoint_dir, method):
    graphs.test_greedy_speculation_with_graphs_equals_plain_module_decoding(
        _dirs(jamba_dir, checkpoint_dir), "jamba_dense", method
    )


def _broken_copy(source, target, edit):
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


def test_preflight_names_missing_and_mis_shaped_tensors(jamba_dir, tmp_path):
    source = jamba_dir("jamba_moe")
    check_model(str(source))
    check_model(str(jamba_dir("jamba_dense")))
    missing = _broken_copy(source, tmp_path / "missing", lambda t: t.pop("model.layers.0.mamba.x_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weight \['model.layers.0.mamba.x_proj.weight'\]"):
        check_model(missing)

    def reshape(tensors):
        tensors["model.layers.2.mamba.A_log"] = tensors["model.layers.2.mamba.A_log"][:, :8].contiguous()
        tensors["model.layers.3.feed_forward.experts.1.up_proj.weight"] = torch.zeros(40, 64)

    mis_shaped = _broken_copy(source, tmp_path / "mis_shaped", reshape)
    with pytest.raises(ValueError) as error:
        check_model(mis_shaped)
    assert "'model.layers.2.mamba.A_log' has shape (128, 8)" in str(error.value)
    assert "'model.layers.3.feed_forward.experts.1.up_proj.weight' has shape (40, 64)" in str(error.value)
