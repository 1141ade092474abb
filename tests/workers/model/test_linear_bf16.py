"""dtype="bfloat16" on CPU: the bf16 linear kernel's paths (AMX, AVX512-BF16, portable) against PyTorch, per-row
results independent of the batch, and whole models — bf16 linears and float32 elsewhere, the decode plan running
them, logits close to float32's, greedy speculative == greedy plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.spec_decode.test_state_shifting import assert_forced_acceptance_exact
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.kernels import native
from workers.model.layers.linear import NativeLinear
from workers.model.steps.decode_plan import DecodePlan
from workers.model.steps.plan_records import Op

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")
if native.available():
    from workers.model.kernels import native_bf16

PATHS = ["portable", "avx512", "amx"]
FAMILIES = ["granite_dense", "qwen3_5"]  # Mamba2 + attention; Gated DeltaNet + gated attention (both tied)
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 9, 30, 31, 4, 77, 12], [8, 8, 8, 9, 8, 8, 8, 9, 8], [100, 3], [40, 41, 42, 40, 41, 42, 40]]


def _skip_unless_available(path: str) -> None:
    if not native_bf16.path_available(path):
        pytest.skip(f"the {path} bfloat16 path cannot run here (CPU, OS or compiler lacks it)")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """F.linear in float64 of the bf16-rounded weight and (but for the portable path) the bf16-rounded x."""
    x = x if path == "portable" else x.bfloat16().float()
    bias = None if bias is None else bias.double()
    return F.linear(x.double(), weight.bfloat16().double(), bias).float()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_equals_reference_for_every_tiling(path, bias):
    _skip_unless_available(path)
    width = int(native.load().linear_panel_width())
    # Panels of 48 outputs, K padded to 32, chunks of 128 k pairs, tiles of 8 (16 for AMX) rows, blocks of 64 rows.
    for in_features, out_features in [(37, 5), (33, 100), (300, 144), (301, 49)]:
        weight, b = torch.randn(out_features, in_features), torch.randn(out_features) if bias else None
        panels = native_bf16.pack_panels_bf16(weight, width)
        for rows in (0, 1, 2, 7, 8, 13, 16, 17, 33, 65, 70):
            x = torch.randn(rows, in_features)
            out = native_bf16.linear_bf16(x, panels, b, out_features, path)
            torch.testing.assert_close(out, _reference(x, weight, b, path), atol=2e-4, rtol=1e-5)
            if rows:  # a row's result is the same bits whatever batch it is in
                alone = torch.cat(
                    [native_bf16.linear_bf16(x[i : i + 1], panels, b, out_features, path) for i in range(rows)]
                )
                assert torch.equal(out, alone), f"{rows} rows, {in_features} → {out_features}"


def test_panels_hold_k_pairs_of_the_rounded_weight():
    width = int(native.load().linear_panel_width())
    weight = torch.randn(50, 37)
    panels = native_bf16.pack_panels_bf16(weight, width)
    num_panels = -(-50 // width)  # the panel width is the instruction set's (12, 24 or 48 columns)
    assert panels.dtype == torch.bfloat16 and panels.shape == (num_panels, 32, width, 2)  # K 37 → 64
    padded = torch.zeros(num_panels * width, 64, dtype=torch.bfloat16)
    padded[:50, :37] = weight.bfloat16()
    assert torch.equal(panels, padded.view(num_panels, width, 32, 2).transpose(1, 2))


def test_the_process_path_is_fixed_and_a_missing_one_refused():
    assert native_bf16.bf16_path() == native_bf16.bf16_path()
    assert native_bf16.path_available(native_bf16.bf16_path())
    with pytest.raises(ValueError, match="must be one of"):
        native_bf16.path_available("avx2")


@pytest.fixture(scope="module")
def runners(checkpoint_dir):
    cache = {}

    def get(family: str, dtype: str, path: str | None = None, **options) -> ModelRunner:
        key = (family, dtype, path, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = ModelRunner.from_pretrained(
                str(checkpoint_dir(family)), max_num_seqs=4, dtype=dtype, **options
            )
            if path is not None:  # a kernel path for this model's linears (before any plan records them)
                for module in cache[key].model.modules():
                    if isinstance(module, NativeLinear) and module.bf16_path is not None:
                        module.bf16_path = path
        return cache[key]

    return get


def _log_probs(runner: ModelRunner) -> torch.Tensor:
    rows = [p + [7, 3, 11, 2] for p in PROMPTS]
    return torch.cat([torch.tensor(s.token_logprobs) for s in runner.score(rows)])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", PATHS)
def test_bf16_model_has_bf16_linears_float32_elsewhere_and_stays_close(family, path, runners):
    _skip_unless_available(path)
    bf16, full = runners(family, "bfloat16", path), runners(family, "float32")
    linears = [m for m in bf16.model.modules() if isinstance(m, NativeLinear)]
    assert bf16.model.lm_head in linears and all(m.panels.dtype == torch.bfloat16 for m in linears)
    assert bf16.model.embed_tokens.weight.dtype == torch.float32 and bf16.dtype == torch.float32
    scores = _log_probs(bf16)
    delta = (scores - _log_probs(full)).abs().max()
    assert 0 < delta < 0.25, delta  # bf16 weights move these random 64-wide models' log-probs a little (≤ 0.07 seen)
    if path == "portable":  # float32 x: what PyTorch computes from the bf16-rounded weights (float rounding apart)
        rounded = runners(family, "float32", linear_backend="torch")
        with torch.no_grad():
            for module in rounded.model.modules():
                if isinstance(module, torch.nn.Linear) and module.out_features > 1:  # not the float shared gates
                    module.weight = torch.nn.Parameter(module.weight.bfloat16().float())  # untied: embeddings stay
        torch.testing.assert_close(scores, _log_probs(rounded), atol=2e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", PATHS)
def test_bf16_decode_plan_runs_the_bf16_kernel_and_equals_module_path(family, path, runners):
    _skip_unless_available(path)
    planned = runners(family, "bfloat16", path)
    tokens = [r.token_ids for r in planned.generate(PROMPTS, PARAMS)]
    plan = planned._scheduler.workspace.plan
    assert isinstance(plan, DecodePlan)
    codes = plan.records(len(PROMPTS), 1)[:, 0]
    assert (codes == Op.LINEAR_BF16).any() and not (codes == Op.LINEAR).any()
    modules = runners(family, "bfloat16", path, decode_plan=False).generate(PROMPTS, PARAMS)
    assert tokens == [r.token_ids for r in modules]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("family", "method"), [("granite_dense", "ngram"), ("qwen3_5", "self")])
def test_bf16_greedy_speculative_equals_greedy_plain(family, method, path, runners, checkpoint_dir):
    _skip_unless_available(path)
    if method == "ngram":
        speculative = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed")
    else:  # the model drafting for itself, bf16 too: every draft is the verification's greedy token
        speculative = SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(family)), policy="fixed")
    spec = runners(family, "bfloat16", path, speculative=speculative)
    if method == "self":  # the draft's linears on the same path
        for module in spec.draft_model.modules():
            if isinstance(module, NativeLinear):
                module.bf16_path = path
    results = spec.generate(PROMPTS, PARAMS)
    plain = runners(family, "bfloat16", path).generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    stats = spec.spec_stats()
    assert stats["num_drafts"] > 0
    if method == "self":
        assert stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("path", PATHS)
def test_bf16_forced_acceptance_keeps_states_and_output_exact(path, runners):
    _skip_unless_available(path)
    # The states are compared with a fresh prefill's, whose float32 rounding differs from the decode steps' (as in
    # float32); the AMX / AVX512 paths then round x to bf16, which turns a last-bit difference into a bf16 one
    # (≤ 4e-3 seen). A wrong shift is off by O(0.1); the output must still equal plain greedy decoding exactly.
    runner = runners("qwen3_5", "bfloat16", path)
    if path == "portable":
        assert_forced_acceptance_exact(runner)
    else:
        assert_forced_acceptance_exact(runner, dict(atol=1e-2, rtol=1e-2))


def test_bf16_with_int8_or_without_native_linears(checkpoint_dir):
    path = str(checkpoint_dir("granite_dense"))
    with pytest.raises(ValueError, match="cannot be combined with dtype='bfloat16'"):
        load_checkpoint(path, dtype="bfloat16", quantization="int8")
    torch_path = load_checkpoint(path, dtype="bfloat16", linear_backend="torch").model  # today's all-torch model
    assert torch_path.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(isinstance(m, NativeLinear) for m in torch_path.modules())
    assert load_checkpoint(path).model.embed_tokens.weight.dtype == torch.float32  # "auto" on CPU stays float32


def test_bf16_without_a_compiler_is_the_torch_model(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(native, "_LIBRARIES", {})
    monkeypatch.setattr(native, "_LOAD_ERRORS", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    model = load_checkpoint(str(checkpoint_dir("granite_dense")), dtype="bfloat16").model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(isinstance(m, NativeLinear) for m in model.modules())
