"""quantization="int8" (int8 × int8, layers/linear_w8a8.py) and "int8_weight_only" (int8 × float32): the weight-only
kernel against its PyTorch reference, per-row results independent of the batch, and whole models under both — the
int8 kernels everywhere, decode plan == module path, greedy speculative == greedy plain, close to float32. The
int8 × int8 kernel itself: test_w8a8.py."""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.kernels import native
from workers.model.layers.linear import Int8Linear, NativeLinear, prepare_linears, quantize_int8
from workers.model.layers.linear_w8a8 import HEAD_GROUP_SIZE, HEAD_TOP_K, W8A8Linear, W8A8Reference
from workers.model.steps.plan_records import RECORD_WORDS, Op

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")

QUANTIZATIONS = ["int8", "int8_weight_only", "w8a8"]
FAMILIES = ["granite_dense", "qwen3_5"]  # Mamba2 + attention; Gated DeltaNet + gated attention (both tied)
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 9, 30, 31, 4, 77, 12], [8, 8, 8, 9, 8, 8, 8, 9, 8], [100, 3], [40, 41, 42, 40, 41, 42, 40]]


@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_equals_reference_for_every_row_tiling(bias):
    # Panels of 48 outputs, chunks of 256 inputs, tiles of 8 rows then 1 … 7, blocks of 64 rows: every tail is hit.
    for in_features, out_features in [(37, 5), (300, 100), (600, 144)]:
        linear = torch.nn.Linear(in_features, out_features, bias=bias)
        int8, reference = NativeLinear(linear, "int8_weight_only"), Int8Linear(linear)
        assert int8.panels.dtype == torch.int8 and torch.equal(int8.scale, reference.scale)
        for rows in (0, 1, 3, 7, 8, 13, 65, 131):
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(int8(x), reference(x), atol=1e-4, rtol=1e-4)
            if 0 < rows < 20:  # a row's result is the same bits whatever batch it is in
                alone = torch.cat([int8(x[i : i + 1]) for i in range(rows)])
                assert torch.equal(int8(x), alone), f"{rows} rows"


def test_quantization_is_symmetric_per_output_channel():
    weight = torch.randn(70, 33)
    weight[3] = 0  # an all-zero channel keeps scale 1 (no division by zero)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale[3] == 1 and not q[3].any()
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()  # rounded to nearest


def test_float32_panels_unchanged_by_the_copy_free_packing():
    weight = torch.randn(101, 40)
    width = int(native.load().linear_panel_width())
    padded = torch.zeros(-(-101 // width) * width, 40)
    padded[:101] = weight
    expected = padded.view(-1, width, 40).transpose(1, 2).contiguous()
    assert torch.equal(native.pack_panels(weight), expected)


def test_invalid_quantization_names_the_allowed_values(checkpoint_dir):
    path = str(checkpoint_dir("granite_dense"))
    with pytest.raises(ValueError, match="quantization='int4' is invalid: must be one of int8, int8_weight_only, w8a8"):
        load_checkpoint(path, quantization="int4")
    with pytest.raises(ValueError, match="runs on CPU with float32 activations"):
        load_checkpoint(path, dtype="float16", quantization="int8")
    with pytest.raises(ValueError, match="cannot be combined with dtype='bfloat16'"):
        load_checkpoint(path, dtype="bfloat16", quantization="int8")
    with pytest.raises(ValueError, match="onednn"):
        prepare_linears(
            torch.nn.Sequential(torch.nn.Linear(4, 4)), "onednn", torch.device("cpu"), torch.float32, "int8"
        )


@pytest.fixture(scope="module")
def runners(checkpoint_dir):
    cache = {}

    def get(family: str, quantization: str | None, **options) -> ModelRunner:
        key = (family, quantization, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = ModelRunner.from_pretrained(
                str(checkpoint_dir(family)), max_num_seqs=4, quantization=quantization, **options
            )
        return cache[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_int8_model_runs_the_int8_kernel_everywhere_and_stays_close_to_float32(family, quantization, runners):
    int8, full, reference = (
        runners(family, quantization),
        runners(family, None),
        runners(family, quantization, linear_backend="torch"),
    )
    linears = [m for block in int8.model.blocks for m in block.modules() if isinstance(m, NativeLinear)]
    assert linears and all(m.scale is not None for m in linears)
    head, reference_head = int8.model.lm_head, reference.model.lm_head
    assert all(isinstance(m, W8A8Linear) == (quantization == "w8a8") for m in linears)
    if quantization != "int8_weight_only":  # an int8 × int8 LM head per group of inputs, its top logits re-ranked
        assert isinstance(head, W8A8Linear) and head.packed.group_size == HEAD_GROUP_SIZE
        assert head.top_k == HEAD_TOP_K and head.float_weight.data_ptr() == int8.model.embed_tokens.weight.data_ptr()
        assert isinstance(reference_head, W8A8Reference) and reference_head.group_size == HEAD_GROUP_SIZE
    else:
        assert head.scale is None  # the LM head stays float32 (by measurement)
    assert int8.model.embed_tokens.weight.dtype == torch.float32  # embeddings, norms, conv, states stay float32
    rows = [p + [7, 3, 11, 2] for p in PROMPTS]
    scores = {
        name: torch.cat([torch.tensor(s.token_logprobs) for s in r.score(rows)])
        for name, r in (("int8", int8), ("float32", full), ("reference", reference))
    }
    # The native int8 kernels compute what PyTorch computes from the same int8 weights, float rounding apart; where
    # the LM head quantizes its activations too, a rounding difference upstream can move one activation across a
    # quantization level (one level of one input moves a logit by ≤ max|x| · max|w| / 127, ~1e-3 at these sizes;
    # seen on the SSE build, whose float32 sums have no fused multiply-add) …
    tolerance = 1e-4 if quantization == "int8_weight_only" else 2e-3
    torch.testing.assert_close(scores["int8"], scores["reference"], atol=tolerance, rtol=0)
    # … which moves the log-probs of these random 64-wide models off float32's by a little (≤ 0.14 seen).
    delta = (scores["int8"] - scores["float32"]).abs().max()
    assert 0 < delta < 0.5, delta


@pytest.mark.parametrize("family", ["qwen3_5"])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_int8_decode_plan_equals_module_path(family, quantization, runners):
    planned_runner = runners(family, quantization)
    planned = planned_runner.generate(PROMPTS, PARAMS)
    modules = runners(family, quantization, decode_plan=False).generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in planned] == [r.token_ids for r in modules]
    plan = planned_runner._scheduler.workspace.plan
    codes = {int(code) for records in plan._records.values() for code in records.view(-1, RECORD_WORDS)[:, 0]}
    assert (Op.LINEAR_W8A8 in codes) == (quantization != "int8_weight_only")
    assert (Op.LINEAR_INT8 in codes) == (quantization != "w8a8")


@pytest.mark.parametrize(("family", "method"), [("granite_dense", "ngram"), ("qwen3_5", "self")])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_int8_greedy_speculative_equals_greedy_plain(family, method, quantization, runners, checkpoint_dir):
    if method == "ngram":
        speculative = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed")
    else:  # the model drafting for itself, int8 too: every draft is the verification's greedy token
        speculative = SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(family)), policy="fixed")
    spec = runners(family, quantization, speculative=speculative)
    results = spec.generate(PROMPTS, PARAMS)
    plain = runners(family, quantization).generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    stats = spec.spec_stats()
    assert stats["num_drafts"] > 0
    if method == "self":
        assert stats["acceptance_rate"] == 1.0
