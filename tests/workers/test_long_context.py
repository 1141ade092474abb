"""Long contexts in bounded memory: chunked prefill and scoring equal one-shot runs, the token budget holds every
forward, admission waits for KV room, and a request's KV follows its own length."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import FAMILIES, QWEN_GDN_FAMILIES, draft_for, engine_config
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model.layers import attention
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.long_attention import long_attention
from workers.model.steps.decode_plan import DecodePlan
from workers.requests import Request
from workers.sampling import make_generator
from workers.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Chunks change the order of float32 sums (a chunked scan from a carried state, not one scan): 1e-5 absolute,
# plus 1e-5 relative for log-probs of larger magnitude.
LOGPROB_TOL = dict(atol=1e-5, rtol=1e-5)


def _prompts(vocab_size: int, seed: int = 0, long: bool = True) -> list[list[int]]:
    """Lengths 8 … 14 end at every offset of a 7-token chunk; 66 crosses 64."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in [*range(8, 15), *[66] * long]]


def _runner_like(runner: ModelRunner, **options) -> ModelRunner:
    """Another runner over the same loaded model (and draft), with other scheduling options."""
    return ModelRunner(
        runner.model,
        runner.tokenizer,
        runner.eos_token_ids,
        max_num_seqs=runner.max_num_seqs,
        speculative=runner.speculative,
        draft_model=runner.draft_model,
        **options,
    )


def _speculative(method: str, family: str, checkpoint_dir) -> SpeculativeConfig | None:
    if method == "none":
        return None
    if method == "draft":
        return SpeculativeConfig(
            "draft", 3, draft_model=str(checkpoint_dir(draft_for(family, "draft_hybrid"))), policy="fixed"
        )
    return SpeculativeConfig(method, 3, policy="fixed")


CASES = [(family, "none") for family in FAMILIES] + [(family, "ngram") for family in FAMILIES]
CASES += [("granite_dense", "draft"), ("qwen3_5", "draft")] + [(family, "mtp") for family in QWEN_GDN_FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "method"), CASES)
def test_greedy_generation_does_not_depend_on_the_token_budget(family, method, checkpoint_dir, monkeypatch):
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir(family)), max_num_seqs=4, speculative=_speculative(method, family, checkpoint_dir)
    )
    prompts = _prompts(runner.config.vocab_size)
    expected = [r.token_ids for r in runner.generate(prompts, GREEDY)]  # budget 4096: every prompt in one forward
    budgets = (1, 7, 64) if method == "none" else (7,)  # 7: chunks and verification rows share the budget
    for budget in budgets:
        some = prompts if budget > 1 else prompts[:-1]  # one token per forward: the short prompts suffice
        got = [r.token_ids for r in _runner_like(runner, max_num_batched_tokens=budget).generate(some, GREEDY)]
        assert got == expected[: len(some)], f"budget {budget}"
    # Every chunk through the long-context attention path (prefix and chunk merged by log-sum-exp).
    monkeypatch.setattr(attention, "LONG_ATTENTION_SCORES", 0)
    got = [r.token_ids for r in _runner_like(runner, max_num_batched_tokens=7).generate(prompts, GREEDY)]
    assert got == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scoring_does_not_depend_on_the_token_budget(family, checkpoint_dir, monkeypatch):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=4)
    sequences = _prompts(runner.config.vocab_size, seed=1)
    expected = [r.token_logprobs for r in runner.score(sequences)]
    for budget, long_path in ((1, False), (7, False), (64, False), (7, True)):
        if long_path:
            monkeypatch.setattr(attention, "LONG_ATTENTION_SCORES", 0)
        some = sequences if budget > 1 else sequences[:-1]
        got = _runner_like(runner, max_num_batched_tokens=budget).score(some)
        for row, (result, want) in enumerate(zip(got, expected)):
            assert len(result.token_logprobs) == len(want)
            torch.testing.assert_close(
                torch.tensor(result.token_logprobs),
                torch.tensor(want),
                **LOGPROB_TOL,
                msg=lambda m, b=budget, r=row: f"budget {b}, row {r}: {m}",
            )


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_no_forward_sees_more_tokens_than_the_budget(method, checkpoint_dir, monkeypatch):
    family = "granite_dense"
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir(family)), max_num_seqs=4, speculative=_speculative(method, family, checkpoint_dir)
    )
    seen: list[int] = []
    forward, execute = HybridModel.forward, DecodePlan._execute

    def counting_forward(self, input_ids, *args, **kwargs):
        seen.append(input_ids.numel())  # padded tokens: rows × the widest row
        return forward(self, input_ids, *args, **kwargs)

    def counting_execute(self, token_ids, positions):
        seen.append(len(token_ids) * len(token_ids[0]))
        return execute(self, token_ids, positions)

    monkeypatch.setattr(HybridModel, "forward", counting_forward)
    monkeypatch.setattr(DecodePlan, "_execute", counting_execute)
    prompts = _prompts(runner.config.vocab_size)
    for budget in (7, 16):
        seen.clear()
        _runner_like(runner, max_num_batched_tokens=budget).generate(prompts, GREEDY)
        assert seen and max(seen) <= budget
        assert max(seen) == budget  # the budget is used, not just respected


def _memory_for_blocks(runner: ModelRunner, num_blocks: int) -> int:
    """A `max_memory` that leaves exactly `num_blocks` usable KV blocks after what the runner needs besides (for a
    runner without prefix caching, whose checkpoints take a share of the memory left)."""
    plan = runner.memory_plan
    return plan.reserved_bytes - plan.prefix_checkpoint_bytes + num_blocks * plan.bytes_per_block


def test_a_small_kv_budget_runs_fewer_requests_at_a_time_with_the_same_results(checkpoint_dir, monkeypatch):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("bamba")), max_num_seqs=8)
    prompts = _prompts(runner.config.vocab_size, long=False)  # 8 … 14 tokens + 6 generated: 1–2 blocks of 16
    expected = [r.token_ids for r in runner.generate(prompts, GREEDY)]
    small = _runner_like(runner, max_memory=_memory_for_blocks(runner, 3), enable_prefix_caching=False)
    assert small.num_kv_blocks == 4
    live: list[int] = []
    admit = Scheduler._admit

    def recording_admit(self):
        admit(self)
        live.append(len(self.running) + len(self.prefilling))

    monkeypatch.setattr(Scheduler, "_admit", recording_admit)
    results = small.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert max(live) == 3  # 3 blocks hold the three shortest requests' reservations at a time, not all 7


def test_a_request_that_can_never_fit_gets_an_error_and_the_rest_run(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_moe")), max_num_seqs=4)
    prompts = _prompts(runner.config.vocab_size)  # the last has 66 tokens: 72 positions, 5 blocks
    small = _runner_like(runner, max_memory=_memory_for_blocks(runner, 4), enable_prefix_caching=False)
    results = small.generate(prompts, GREEDY)
    expected = runner.generate(prompts[:-1], GREEDY)
    assert [r.token_ids for r in results[:-1]] == [r.token_ids for r in expected]
    assert results[-1].finish_reason == "error" and results[-1].token_ids == []
    assert "72 KV cache positions" in results[-1].error and "max_memory" in results[-1].error
    scores = small.score(prompts)
    assert scores[-1].error is not None and "KV cache holds" in scores[-1].error
    assert all(s.error is None for s in scores[:-1])


def test_a_max_memory_below_the_weights_is_refused_before_work_starts(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("bamba")), max_num_seqs=4)
    with pytest.raises(ValueError, match="max_memory leaves no room for a KV cache"):
        _runner_like(runner, max_memory="1MB")
    with pytest.raises(ValueError, match="max_memory"):
        _runner_like(runner, max_memory="lots")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _runner_like(runner, gpu_memory_utilization=1.5)


def test_kv_memory_follows_each_requests_own_length(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_dense")), max_num_seqs=16)
    rng = random.Random(3)
    lengths = [400] + [10] * 15
    requests = [
        Request(
            i,
            [rng.randrange(runner.config.vocab_size) for _ in range(n)],
            GREEDY,
            frozenset(),
            make_generator(GREEDY, torch.device("cpu"), 0),
            runner.max_model_len,
        )
        for i, n in enumerate(lengths)
    ]
    scheduler = Scheduler(runner.model, engine_config(16, max_num_batched_tokens=256), requests)
    while scheduler.prefilling or scheduler.waiting or not scheduler.running:
        scheduler.step()
    used = sum(len(owned) for owned in scheduler.blocks.owned) * scheduler.blocks.block_size
    own = sum(r.num_tokens for r in scheduler.running)
    assert own <= used <= own + 16 * scheduler.blocks.block_size  # at most one partly filled block per request
    assert used < 0.2 * 16 * (400 + GREEDY.max_tokens)  # a slot-per-longest-request cache would hold 5×+ more


@pytest.mark.parametrize(("prefix", "num_new", "heads", "kv_heads"), [(0, 9, 4, 2), (50, 9, 4, 2), (300, 1, 8, 8)])
def test_long_attention_equals_masked_attention(prefix, num_new, heads, kv_heads):
    g = torch.Generator().manual_seed(prefix + num_new)
    span, head_dim = prefix + num_new, 16
    storage_k, storage_v = (torch.randn(kv_heads, span + 40, head_dim, generator=g) for _ in range(2))
    keys, values = storage_k[None, :, 20 : 20 + span], storage_v[None, :, 20 : 20 + span]  # strided views
    q = torch.randn(1, heads, num_new, head_dim, generator=g)
    out = long_attention(q, keys, values, 0.25, num_new + 2)
    mask = torch.arange(span)[None, :] <= (prefix + torch.arange(num_new))[:, None]
    reference = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out[:, :, :num_new], reference, atol=1e-6, rtol=1e-5)
    assert torch.equal(out[:, :, num_new:], torch.zeros(1, heads, 2, head_dim))
