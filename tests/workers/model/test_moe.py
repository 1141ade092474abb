"""Mixture-of-experts on every path: the routers against a float64 reference (ties included), the native experts
against a float64 reference in every weight format, and a row's output independent of the rows beside it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.model.checkpoint.config import FeedForwardConfig
from workers.model.kernels import native, native_moe
from workers.model.layers import moe
from workers.model.layers.linear import quantize_int8

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")

BASE = FeedForwardConfig(intermediate_size=0, gated=True, bias=False, num_experts=8, experts_per_token=3)
ROUTERS = {
    "softmax-then-top-k (Granite, Jamba)": dataclasses.replace(BASE, norm_topk_prob=False),
    "top-k-then-softmax (Qwen)": BASE,
    "sigmoid, bias, groups (Nemotron-H, Kimi)": dataclasses.replace(
        BASE, router="sigmoid", num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5
    ),
    "sigmoid, groups, no renormalisation": dataclasses.replace(
        BASE, router="sigmoid", num_expert_groups=2, topk_groups=1, norm_topk_prob=False
    ),
    "sigmoid, one group, eps (LFM2-MoE)": dataclasses.replace(BASE, router="sigmoid", topk_norm_eps=1e-6),
}


def reference_route(logits: torch.Tensor, ff: FeedForwardConfig, bias: torch.Tensor | None):
    """Each row's experts and weights in float64, one row and one choice at a time; ties to the lower index."""

    def best(values: list[float], k: int, allowed: list[bool] | None = None) -> list[int]:
        order = sorted((i for i in range(len(values)) if allowed is None or allowed[i]), key=lambda i: (-values[i], i))
        return order[:k]

    weights, ids = [], []
    for row in logits.double().tolist():
        k = ff.experts_per_token
        if ff.router == "softmax":
            probs = torch.softmax(torch.tensor(row, dtype=torch.float64), 0).tolist()
            chosen = best(row if ff.norm_topk_prob else probs, k)
            w = [probs[i] for i in chosen]
            w = [v / sum(w) for v in w] if ff.norm_topk_prob else w
        else:
            scores = [1 / (1 + torch.exp(torch.tensor(-v, dtype=torch.float64)).item()) for v in row]
            choice = [s + (0.0 if bias is None else float(bias[i])) for i, s in enumerate(scores)]
            size = ff.num_experts // ff.num_expert_groups
            groups = [choice[g * size : (g + 1) * size] for g in range(ff.num_expert_groups)]
            group_scores = [sum(sorted(g, reverse=True)[:2]) for g in groups]
            kept = best(group_scores, ff.topk_groups)
            chosen = best(choice, k, [i // size in kept for i in range(ff.num_experts)])
            w = [scores[i] for i in chosen]
            w = [v / (sum(w) + ff.topk_norm_eps) for v in w] if ff.norm_topk_prob else w
            w = [v * ff.routed_scaling_factor for v in w]
        weights.append(w)
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


def router_logits(num_experts: int) -> torch.Tensor:
    """Random rows, then rows of ties: all equal, a tie inside the top k, a tie at its edge, tied groups."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(num_experts, generator=g) * 2 for _ in range(16)]
    rows.append(torch.full((num_experts,), 0.25))
    rows.append(torch.tensor([0.5, 3.0, -1.0, 3.0, 0.0, 2.0, 2.0, -2.0]))  # 3.0 twice, then 2.0 twice at the edge
    rows.append(torch.tensor([1.0, 0.5, -3.0, -3.0, 1.0, 0.5, -3.0, -3.0]))  # groups of 2: 0 and 2 tie
    rows.append(torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
    return torch.stack(rows)


@pytest.mark.parametrize("path", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_router_matches_a_float64_reference_ties_included(name, path):
    ff = ROUTERS[name]
    logits = router_logits(ff.num_experts)
    bias = torch.tensor([0.0, 0.1, 0.0, -0.1, 0.0, 0.0, 0.2, 0.0]) if ff.router == "sigmoid" else None
    for b in (bias, None) if bias is not None else (None,):
        expected_weights, expected_ids = reference_route(logits, ff, b)
        route = native_moe.route if path == "native" else moe.route
        weights, ids = route(logits, ff, b)
        assert ids.tolist() == expected_ids.tolist(), name
        torch.testing.assert_close(weights.double(), expected_weights, rtol=2e-6, atol=1e-7)


def expert_weights(num_experts: int, width: int, inter: int, gated: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(num_experts, inter * (2 if gated else 1), width, generator=g) / width**0.5
    down = torch.randn(num_experts, width, inter, generator=g) / inter**0.5
    return up, down


def stored(weight: torch.Tensor, weight_format: str | None) -> torch.Tensor:
    """The weights as a format stores them, back in float64 (the reference multiplies these)."""
    if weight_format == "int8_weight_only":
        return torch.stack([(lambda q, s: q.double() * s.double()[:, None])(*quantize_int8(w)) for w in weight])
    if weight_format == "bfloat16":
        return weight.bfloat16().double()
    return weight.double()


def reference_experts(x, weights, ids, up, down, gated):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for s in range(ids.shape[1]):
            h = up[ids[r, s]] @ x[r].double()
            if gated:
                gate, value = h.chunk(2)
                h = torch.nn.functional.silu(gate) * value
            else:
                h = torch.relu(h) ** 2
            out[r] += weights[r, s].double() * (down[ids[r, s]] @ h)
    return out


def routing(t: int, num_experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g), ids


FORMATS = [None, "int8_weight_only", "bfloat16"]


@needs_native
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("weight_format", FORMATS)
def test_native_experts_match_a_float64_reference_in_every_format(weight_format, gated):
    # Widths that are not multiples of a panel (48 and 40 columns) nor of a bf16 k pair (an odd intermediate).
    num_experts, width, inter, k, t = 6, 40, 23, 2, 9
    up, down = expert_weights(num_experts, width, inter, gated, seed=1)
    packed = native_moe.pack_experts(up, down, gated, weight_format)
    x = torch.randn(t, width, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(t, num_experts, k, seed=3)
    got = native_moe.experts(x, weights, ids, packed)
    expected = reference_experts(x, weights, ids, stored(up, weight_format), stored(down, weight_format), gated)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


@needs_native
@pytest.mark.parametrize("weight_format", FORMATS)
def test_a_rows_experts_do_not_depend_on_the_rows_beside_it(weight_format):
    """Row 0 alone, then in batches of 5, 16 and 33 whose other rows choose other experts: the same bits."""
    num_experts, width, inter, k = 16, 64, 48, 4
    up, down = expert_weights(num_experts, width, inter, True, seed=4)
    packed = native_moe.pack_experts(up, down, True, weight_format)
    x = torch.randn(33, width, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(33, num_experts, k, seed=6)
    alone = native_moe.experts(x[:1].contiguous(), weights[:1].contiguous(), ids[:1].contiguous(), packed)
    threads = torch.get_num_threads()
    try:  # one thread runs each expert's linears whole, several split experts (or their linears) between them
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for b in (1, 5, 16, 33):
                batch = native_moe.experts(x[:b].contiguous(), weights[:b].contiguous(), ids[:b].contiguous(), packed)
                assert torch.equal(batch[0], alone[0]), (b, num_threads)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_expert_ids_outside_the_experts_are_refused():
    up, down = expert_weights(4, 16, 8, True, seed=7)
    packed = native_moe.pack_experts(up, down, True, None)
    weights, ids = torch.ones(2, 1), torch.tensor([[1], [4]])
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        native_moe.experts(torch.zeros(2, 16), weights, ids, packed)


def test_the_torch_paths_agree_with_each_other_and_the_reference():
    """The eager form (one pair of matmuls per used expert) and the static form (grouped GEMMs over sorted rows)."""
    num_experts, width, inter, k, t = 5, 32, 16, 2, 7
    up, down = expert_weights(num_experts, width, inter, True, seed=8)
    x = torch.randn(t, width, generator=torch.Generator().manual_seed(9))
    _, ids = routing(t, num_experts, k, seed=10)
    ids[3] = torch.tensor([4, 0])  # an expert no other row uses; expert 1 maybe none
    eager = moe._rows_eager(x, ids, up, down, True)
    static = moe._rows_grouped(x, ids, up, down, True)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-6)
    expected = reference_experts(x, torch.ones(t, k), ids, up.double(), down.double(), True)
    torch.testing.assert_close(eager.view(t, k, width).sum(1).double(), expected, rtol=1e-4, atol=1e-5)


def test_invalid_groupings_are_refused():
    from workers.model.checkpoint.config import HybridConfig

    config = HybridConfig.__new__(HybridConfig)
    ff = dataclasses.replace(ROUTERS["sigmoid, bias, groups (Nemotron-H, Kimi)"], num_expert_groups=3)
    object.__setattr__(config, "feed_forward", ff)
    object.__setattr__(config, "hidden_size", 16)
    with pytest.raises(ValueError, match="8 experts cannot form 3 groups"):
        moe.MoE(config)


@needs_native
@pytest.mark.parametrize("weights", [{}, {"quantization": "int8"}, {"dtype": "bfloat16"}])
@pytest.mark.parametrize("family", ["granite_moe", "qwen3_5_moe"])
def test_a_rows_logits_through_the_plan_do_not_depend_on_the_batch(checkpoint_dir, family, weights):
    """Row 0 (same token, position and states) alone and among 4, 15 and 32 other rows: the same logits, bit for
    bit, through every layer (the other rows' tokens route to other experts)."""
    from tests.workers.model.plan_checks import clone, random_pool
    from workers.model import load_checkpoint
    from workers.model.steps.decode_plan import DecodePlan

    model = load_checkpoint(str(checkpoint_dir(family)), **weights).model
    pool = random_pool(model, slots=33, capacity=12, seed=11)
    tokens = torch.randint(0, model.config.vocab_size, (33,), generator=torch.Generator().manual_seed(12)).tolist()
    logits = {}
    for b in (1, 5, 16, 33):
        plan = DecodePlan(model, clone(pool))
        logits[b] = plan.run(tokens[:b], [7] + [3] * (b - 1))[0].clone()
    assert all(torch.equal(logits[b], logits[1]) for b in (5, 16, 33))


def test_latent_moe_matches_transformers_and_its_plan_equals_its_module_path(checkpoint_dir, hf_model):
    """Nemotron 3's latent MoE (experts on a 24-wide projection of x): scores as transformers computes them, and
    the decode plan's latent records give the module path's logits bit for bit."""
    from tests.workers.model.plan_checks import clone, module_step, random_pool
    from tests.workers.test_oracle import _hf_logprobs, _prompts
    from workers import ModelRunner
    from workers.model import load_checkpoint
    from workers.model.steps.decode_plan import DecodePlan, unsupported_reason

    path = checkpoint_dir("nemotron_latent_moe")
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=2)
    for sequence, score in zip(sequences := _prompts(3, [9, 21]), runner.score(sequences)):
        reference = _hf_logprobs(hf_model(path), sequence)
        assert (torch.tensor(score.token_logprobs) - reference).abs().max() < 1e-4
    model = load_checkpoint(str(path)).model
    assert unsupported_reason(model) is None
    assert next(block for block in model.blocks if block.kind == "moe").mixer.latent_in is not None
    reference_pool = random_pool(model, slots=3, capacity=12, seed=0)
    plan = DecodePlan(model, planned := clone(reference_pool))
    for step, b in enumerate([3, 1, 2]):
        token_ids, positions = [5 + step, 17, 99][:b], [4 + step, 2, 7][:b]
        expected, _ = module_step(model, reference_pool, token_ids, positions)
        assert torch.equal(plan.run(token_ids, positions), expected), step
    assert torch.equal(planned.ssm, reference_pool.ssm)


OTHER_MOE_FAMILIES = ["jamba_moe", "lfm2_moe", "kimi_linear"]  # Mamba1, short conv, KDA + latent attention


@pytest.fixture(scope="module")
def other_moe(tmp_path_factory):
    """family → its tiny checkpoint directory, from the family's own builder (built on first use)."""
    from tests.kimi_models import build_kimi_checkpoint
    from tests.lfm_models import build_lfm_checkpoint
    from tests.tiny_jamba import build_jamba_checkpoint

    builders = {
        "jamba_moe": build_jamba_checkpoint,
        "lfm2_moe": build_lfm_checkpoint,
        "kimi_linear": build_kimi_checkpoint,
    }
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = builders[family](family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.mark.parametrize("family", OTHER_MOE_FAMILIES)
def test_graph_steps_of_the_other_moe_families_equal_the_module_path_and_are_capture_safe(other_moe, family):
    """Jamba, LFM2-MoE and Kimi-Linear MoE models: graph steps (eager, float32) give the module path's logits and
    states; the captured steps of their bfloat16 models (grouped GEMMs take bfloat16) pass the capture check."""
    from tests.workers.model import test_cuda_graph as graphs
    from workers.model import load_checkpoint
    from workers.model.steps.capture_safety import find_capture_hazards
    from workers.model.steps.cuda_graph import GraphPlan

    graphs.test_graph_steps_equal_the_module_path(other_moe, family)
    model = load_checkpoint(str(other_moe(family)), dtype="bfloat16", decode_kernel="torch", linear_backend="torch")
    with torch.inference_mode():
        plan = GraphPlan(model.model, graphs._pools(model.model, torch.bfloat16)[0], graphs.TOKENS, capture=False)
        plan.verify([[5] * graphs.TOKENS] * 3, [1, 2, 3])  # the warm-up a capture makes
        plan.keep([1, 2, 4])
        for kind in ("decode", "verify", "keep"):
            assert find_capture_hazards(plan.captured_step(kind, plan.buckets[-1])) == [], kind


@pytest.mark.parametrize("family", ["granite_moe", "nemotron_moe", "qwen3_next", "qwen3_5_moe"])
def test_greedy_ngram_speculation_on_moe_targets_through_plans_equals_plain_greedy(checkpoint_dir, family):
    from workers import ModelRunner, SamplingParams, SpeculativeConfig

    path = str(checkpoint_dir(family))
    prompts = [[5, 9, 30, 5, 9, 30, 5, 9], [8, 8, 8, 8], [100, 3, 17, 100, 3, 17, 100], [7]]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = ModelRunner.from_pretrained(path, max_num_seqs=3, decode_plan=False)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    spec = ModelRunner.from_pretrained(
        path, max_num_seqs=3, speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, policy="fixed")
    )
    assert [r.token_ids for r in spec.generate(prompts, params)] == expected
    stats = spec.spec_stats()
    assert stats["num_draft_tokens"] > 0, stats


@needs_native
def test_packed_experts_count_in_the_memory_plan_and_an_mtp_heads_experts_take_the_blocks_format(checkpoint_dir):
    """The CPU memory plan counts the packed weights (the experts leave `parameters()` when packed), and an MTP
    head's experts are packed in the blocks' format even where its linears take the LM head's (int8_weight_only)."""
    from workers.memory import in_use
    from workers.model import load_checkpoint
    from workers.model.layers.moe import MoE

    model = load_checkpoint(str(checkpoint_dir("nemotron_moe")), mtp=True, quantization="int8_weight_only").model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert any(m in list(model.mtp.modules()) for m in moes)
    assert {m.packed.weight_format for m in moes} == {"int8_weight_only"}
    packed = sum(m.packed.nbytes() for m in moes)
    assert in_use(model, torch.device("cpu")) > packed > sum(p.numel() * p.element_size() for p in model.parameters())
