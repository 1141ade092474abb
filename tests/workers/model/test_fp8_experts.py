"""`quantization="fp8"` keeps a block-wise FP8 checkpoint's MoE experts in FP8 (`layers/fp8_experts.py`): one byte
per expert weight plus its block scales, computing what the same weights dequantized into a float32 checkpoint
compute. Tiny models with experts wide enough for real 128 × 128 blocks: Granite's fused `input_linear`
(aligned), Qwen3-Next's per-expert gate / up / down with tails (W = 192, I = 160: gate and up are quantized apart and
their blocks do not line up once stacked), and the same weights in the fused `experts.gate_up_proj` layout."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from tests.tiny_models import _COMMON, _IBM_MAMBA, _QWEN, BOS, EOS, fuse_experts, make_tokenizer, randomise
from tests.workers.model.interpreted import assert_cases_pass_in_the_interpreter, needs_triton
from tests.workers.model.test_fp8_checkpoint import NOT_CONVERTED, ROWS, to_fp8
from workers import ModelRunner, SamplingParams
from workers.model.checkpoint.tensors import CheckpointTensors
from workers.model.distributed.slices import columns, rows
from workers.model.kernels.fp8 import dequantize_split_blocks
from workers.model.layers.fp8_experts import FP8_EXPERTS_GRAPH_REASON, Fp8Experts, fp8_bytes
from workers.model.layers.fp8_linear import FP8_KEPT_REASON
from workers.model.layers.moe import MoE, _rows_eager
from workers.model.loader import load_checkpoint
from workers.model.steps import cuda_graph, decode_plan

BLOCK = [128, 128]
CASES = Path(__file__).with_name("fp8_moe_cases.py")
WIDE = {
    "granite": lambda: GraniteMoeHybridForCausalLM(
        GraniteMoeHybridConfig(
            **{**_COMMON, "hidden_size": 128},
            **{**_IBM_MAMBA, "mamba_n_heads": 8},
            layer_types=["mamba", "attention", "mamba", "mamba"],
            num_hidden_layers=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
            intermediate_size=128,
            position_embedding_type="rope",
        )
    ),
    "qwen3_next": lambda: Qwen3NextForCausalLM(
        Qwen3NextConfig(
            **{**_QWEN, "hidden_size": 192},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=160,
            shared_expert_intermediate_size=64,
            intermediate_size=96,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    ),
}
LAYOUTS = ("granite", "qwen3_next", "qwen3_next_fused")  # the checkpoint layouts of the experts, see the docstring


def build_wide(layout: str, directory: Path) -> Path:
    """A tiny random float32 checkpoint of `layout` with its tokenizer and generation config."""
    family = layout.removesuffix("_fused")
    torch.manual_seed(0)
    model = WIDE[family]()
    randomise(model, 0, zero_centred_norms=family == "qwen3_next")
    model.save_pretrained(directory)
    if layout.endswith("_fused"):
        fuse_experts(directory / "model.safetensors")
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


def quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv, the weight dequantized by the checkpoint reader) of a matrix or an [E, …] stack,
    each expert quantized on its own."""
    if tensor.dim() == 3:
        parts = [quantize(expert) for expert in tensor]
        return tuple(torch.stack(column) for column in zip(*parts))  # type: ignore[return-value]
    weight, scale = to_fp8(tensor.float(), BLOCK)
    reader = CheckpointTensors([], tuple(BLOCK))
    return weight, scale, CheckpointTensors._dequantize(reader, "", weight, scale)


def write_pair(source: Path, fp8: Path, dequantized: Path, skip: str | None = None) -> None:
    """`source` with every block weight (experts too) in block-wise FP8 at `fp8`, and the same weights dequantized
    into a float32 checkpoint at `dequantized` (the oracle); keys containing `skip` stay float."""
    tensors, quantized, plain = load_file(source / "model.safetensors"), {}, {}
    for key, value in tensors.items():
        if value.dim() < 2 or any(part in key for part in NOT_CONVERTED) or (skip and skip in key):
            quantized[key] = plain[key] = value
            continue
        quantized[key], quantized[key + "_scale_inv"], plain[key] = quantize(value)
    for target, out in ((fp8, quantized), (dequantized, plain)):
        shutil.copytree(source, target, dirs_exist_ok=True)
        save_file(out, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": BLOCK, "fmt": "e4m3"}
    (fp8 / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """layout → (its FP8 checkpoint, the same weights dequantized in float32)."""
    out = {}
    for layout in LAYOUTS:
        source = build_wide(layout, tmp_path_factory.mktemp(layout))
        out[layout] = (tmp_path_factory.mktemp(f"{layout}_fp8"), tmp_path_factory.mktemp(f"{layout}_plain"))
        write_pair(source, *out[layout])
    return out


def moes(model: torch.nn.Module) -> dict[str, MoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_stay_fp8_and_dequantize_to_the_checkpoint_weights(pairs, layout, caplog):
    fp8, plain = pairs[layout]
    with caplog.at_level(logging.INFO, logger="workers.model.layers.fp8_experts"):
        model = load_checkpoint(str(fp8), quantization="fp8", linear_backend="torch").model
    reference = moes(load_checkpoint(str(plain), linear_backend="torch").model)
    kept = moes(model)
    assert len(kept) >= 3 and all(isinstance(m.fp8_experts, Fp8Experts) for m in kept.values())
    num_weights = 0
    for name, moe in kept.items():
        experts = moe.fp8_experts
        assert not hasattr(moe, "experts_up") and not hasattr(moe, "experts_down")
        assert experts.up.element_size() == experts.down.element_size() == 1
        assert experts.up_scale.dtype == experts.down_scale.dtype == torch.float32
        num_experts, rows, width = experts.up.shape
        split = 160 if layout == "qwen3_next" else rows  # per-expert gate and up keep their own scales
        assert experts.up_split == split
        assert experts.up_scale.shape == (num_experts, -(-split // 128) + -(-(rows - split) // 128), -(-width // 128))
        num_weights += experts.up.numel() + experts.down.numel()
        for e in range(num_experts):  # bytes and scales read right: exactly the dequantized checkpoint's weights
            up, down = experts.expert(e)
            assert torch.equal(up, reference[name].experts_up[e]), (name, e)
            assert torch.equal(down, reference[name].experts_down[e]), (name, e)
    counts = fp8_bytes(model)
    assert counts["experts"] == num_weights and counts["linears"] > 0
    assert counts["scales"] < num_weights / 1000  # ~1 byte per parameter: the scales are noise
    assert "MiB of weights kept in FP8" in caplog.text and "MoE experts" in caplog.text


@pytest.mark.parametrize("layout", LAYOUTS)
def test_routed_experts_equal_the_dequantized_ones(pairs, layout):
    fp8, plain = pairs[layout]
    kept = moes(load_checkpoint(str(fp8), quantization="fp8", linear_backend="torch").model)
    reference = moes(load_checkpoint(str(plain), linear_backend="torch").model)
    generator = torch.Generator().manual_seed(0)
    for name, moe in kept.items():
        width = moe.fp8_experts.up.shape[2]
        x = torch.randn(9, width, generator=generator)
        ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(9)])  # several per token
        ids[0] = torch.tensor([3, 3])  # the same expert twice; expert 0 unused by some rows
        ref = reference[name]
        assert torch.equal(moe.fp8_experts(x, ids), _rows_eager(x, ids, ref.experts_up, ref.experts_down, ref.gated))
        hidden = torch.randn(2, 5, width, generator=generator)  # the whole block, shared MLP and routing included
        torch.testing.assert_close(moe(hidden), ref(hidden), rtol=1e-5, atol=1e-5)


def _scores(path: Path, **options) -> torch.Tensor:
    runner = ModelRunner.from_pretrained(str(path), **options)
    return torch.cat([torch.tensor(s.token_logprobs) for s in runner.score(ROWS)])


@pytest.mark.parametrize("layout", ["granite", "qwen3_next"])
def test_scores_and_greedy_tokens_equal_the_dequantized_load(pairs, layout):
    fp8, plain = pairs[layout]
    torch.testing.assert_close(_scores(fp8, quantization="fp8"), _scores(plain), rtol=1e-5, atol=1e-5)
    prompts, params = [[5, 9, 30, 31], [8, 8, 9]], SamplingParams(max_tokens=16, temperature=0.0)
    runners = [ModelRunner.from_pretrained(str(plain)), ModelRunner.from_pretrained(str(fp8), quantization="fp8")]
    outputs = [runner.generate(prompts, params) for runner in runners]
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]
    assert all(len(o.token_ids) == 16 for o in outputs[1])


def test_plans_decline_fp8_experts(pairs):
    model = load_checkpoint(str(pairs["granite"][0]), quantization="fp8").model
    assert decode_plan.unsupported_reason(model) == FP8_KEPT_REASON
    assert cuda_graph.unsupported_reason(model) == FP8_EXPERTS_GRAPH_REASON


def test_experts_with_a_float_part_load_dequantized(pairs, tmp_path, caplog):
    plain = pairs["qwen3_next"][1]
    fp8, oracle = tmp_path / "fp8", tmp_path / "plain"
    write_pair(plain, fp8, oracle, skip="layers.0.mlp.experts.2.up_proj")  # one float tensor in layer 0's experts
    with caplog.at_level(logging.INFO, logger="workers.model.layers.fp8_experts"):
        model = load_checkpoint(str(fp8), quantization="fp8", linear_backend="torch").model
    kept = moes(model)
    assert kept["blocks.1.mixer"].fp8_experts is None and kept["blocks.1.mixer"].experts_up.dtype == torch.float32
    assert all(m.fp8_experts is not None for name, m in kept.items() if name != "blocks.1.mixer")
    assert "blocks.1.mixer load dequantized: not every expert tensor is block-wise FP8" in caplog.text
    reference = moes(load_checkpoint(str(oracle), linear_backend="torch").model)["blocks.1.mixer"]
    assert torch.equal(kept["blocks.1.mixer"].experts_up, reference.experts_up)


def test_gate_and_up_keep_their_own_scales():
    weight = torch.full((320, 130), 0x38, dtype=torch.uint8)  # e4m3 0x38 = 1.0; gate rows 0-159, up rows 160-319
    scales = torch.tensor([[2.0, 3.0], [5.0, 7.0], [11.0, 13.0], [17.0, 19.0]])  # gate blocks 0-127, 128-159; up …
    out = dequantize_split_blocks(weight, scales, split=160)
    assert (out[:128, :128] == 2).all() and (out[128:160, :128] == 5).all() and (out[128:160, 128:] == 7).all()
    assert (out[160:288, :128] == 11).all() and (out[288:, 128:] == 19).all()
    with pytest.raises(ValueError, match=r"up_split=0 must lie in 1 … 320"):
        Fp8Experts(2, 320, 130, 160, gated=True, up_split=0)


@needs_triton
def test_fp8_grouped_gemm_matches_the_reference_in_the_interpreter():
    assert_cases_pass_in_the_interpreter(CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fp8_experts_on_cuda_match_the_dequantized_load(pairs):
    fp8, plain = pairs["qwen3_next"]
    model = load_checkpoint(str(fp8), device="cuda", quantization="fp8").model
    assert all(m.fp8_experts is not None and m.fp8_experts.up.is_cuda for m in moes(model).values())
    torch.testing.assert_close(_scores(fp8, device="cuda", quantization="fp8"), _scores(plain), atol=2e-3, rtol=0)


def fake_checkpoint(layout: str, num_experts: int, inner: int, width: int) -> tuple[SimpleNamespace, torch.Tensor]:
    """(FP8 expert tensors as `CheckpointTensors` serves them, the full [E, 2I, W] up weight they dequantize to) in
    the "pairs" (per-expert gate and up) or "fused" (`gate_up_proj`) layout."""
    full = torch.randn(num_experts, 2 * inner, width, generator=torch.Generator().manual_seed(inner))
    if layout == "fused":
        weight, scale, dequantized = quantize(full)
        stored = {"gate_up": (weight.view(torch.uint8), scale)}
    else:
        stored, dequantized = {}, torch.empty_like(full)
        for e in range(num_experts):
            for part, rows in (("gate", slice(0, inner)), ("up", slice(inner, None))):
                weight, scale, dequantized[e, rows] = quantize(full[e, rows])
                stored[f"{e}.{part}"] = (weight.view(torch.uint8), scale)
    shapes = {key: tuple(weight.shape) for key, (weight, _) in stored.items()}
    return SimpleNamespace(shapes=shapes, is_fp8=stored.__contains__, read_fp8=stored.__getitem__), dequantized


@pytest.mark.parametrize(
    "layout, inner, rule, kept",
    [
        ("pairs", 256, rows((128, 128), (384, 128), dim=1), True),  # TP rank 1 of 2: gate and up rows 128-255
        ("fused", 256, rows((0, 128), (256, 128), dim=1), True),  # rank 0; gate and up pieces join on a block
        ("fused", 160, rows((0, 4), dim=0), True),  # expert parallel: all of experts 0-3 of 8
        ("pairs", 256, columns((128, 72), dim=2), True),  # the last columns (a row-parallel down's, W = 200)
        ("pairs", 160, rows((80, 80), (240, 80), dim=1), False),  # I/T = 80: a block would mix two ranks' rows
        ("fused", 256, columns((100, 100), dim=2), False),
        ("fused", 192, rows((0, 96), (192, 96), dim=1), False),  # the up rows start inside a fused block
    ],
)
def test_a_rank_keeps_the_block_aligned_cut_of_the_experts(layout, inner, rule, kept):
    from workers.model.layers.fp8_expert_reads import plan_read, read_experts

    tensors, full = fake_checkpoint(layout, 8, inner, 200)
    keys = ("gate_up",) if layout == "fused" else tuple(f"{e}.{p}" for e in range(8) for p in ("gate", "up"))
    read = plan_read(keys, 8, tensors, rule)
    if not kept:
        assert read == "this rank's rows or columns of the experts do not fall on whole 128 × 128 blocks"
        return
    expected = rule.apply(full, 1)  # the float weights this rank would hold: the oracle
    assert read.shape == tuple(expected.shape)
    experts = Fp8Experts(*read.shape, 160, gated=True, up_split=read.split)
    experts.up_scale = experts.up_scale.float()
    read_experts(read, experts.up, experts.up_scale, tensors)
    for local in range(read.shape[0]):
        torch.testing.assert_close(experts.expert(local)[0], expected[local], rtol=0, atol=0)
