"""Logprobs under speculative decoding are the target's at the accepted positions: the same as plain decoding's for
every method and executor, with prefix caching and chunked prefill, cut with the tokens at a stop; sampled rows
report the logprobs of the tokens they took (raw and processed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_demo_gdn import MODEL as DEMO_GDN
from tests.test_demo_gdn import _texts
from tests.tiny_models import draft_for
from tests.workers.test_logprobs import (
    PROCESSED_PARAMS,
    assert_logprobs_match,
    processed_reference,
    prompts,
    teacher_forced_logits,
)
from workers import GenerationResult, ModelRunner, SamplingParams, SpeculativeConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=4)
EXECUTORS = {
    "module": dict(decode_plan=False, cuda_graphs=False),
    "native": dict(cuda_graphs=False),
    "graph": dict(cuda_graphs=True),  # its eager form on CPU
}
TOLERANCE = 1e-5


def copy_heavy_prompts(seed: int) -> list[list[int]]:
    """4 prompts (through 3 slots) that repeat a phrase, so that n-gram lookup finds drafts."""
    generator = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(4, 128, (n,), generator=generator).tolist() for n in (3, 5, 2, 4)]
    return [phrase * 4 for phrase in phrases]


def speculative(method: str, family: str, checkpoint_dir) -> SpeculativeConfig:
    """Fixed k: ngram; a draft model that is the target itself (every draft accepted, runs of k + 1 tokens); a
    hybrid draft model (some accepted); MTP."""
    if method == "ngram":
        return SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed")
    if method == "mtp":
        return SpeculativeConfig("mtp", 2, policy="fixed")
    draft = family if method == "draft_self" else draft_for(family, "draft_hybrid")
    return SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(draft)), policy="fixed")


def assert_same_logprobs(ours: GenerationResult, plain: GenerationResult) -> None:
    """Same tokens, and at each position the same entries (token ids in the same order, values within 1e-5)."""
    assert ours.token_ids == plain.token_ids
    assert len(ours.logprobs) == len(plain.logprobs) == len(ours.token_ids)
    for position, (entry, expected) in enumerate(zip(ours.logprobs, plain.logprobs)):
        assert list(entry) == list(expected), f"position {position}"
        assert list(entry.values()) == pytest.approx(list(expected.values()), abs=TOLERANCE), f"position {position}"
    assert ours.cumulative_logprob == pytest.approx(plain.cumulative_logprob, abs=TOLERANCE * len(ours.token_ids))


def model_and_prompts(method: str, checkpoint_dir) -> tuple[str, list[list[int]]]:
    """The tiny random granite_dense on copy-heavy prompts; for MTP the trained GDN demo (whose MTP head's drafts are
    accepted, unlike a random one's) on 4 of its prompts."""
    if method != "mtp":
        return str(checkpoint_dir("granite_dense")), copy_heavy_prompts(0)
    tokenizer = ModelRunner.from_pretrained(str(DEMO_GDN), max_num_seqs=1).tokenizer
    return str(DEMO_GDN), [tokenizer.encode(text) for text in _texts(4)]


@pytest.fixture(scope="module")
def plain():
    """(model path, prompts) → plain greedy results, module by module, without prefix caching."""
    cache = {}

    def get(path: str, rows: list[list[int]]) -> list[GenerationResult]:
        if path not in cache:
            runner = ModelRunner.from_pretrained(
                path, max_num_seqs=3, enable_prefix_caching=False, **EXECUTORS["module"]
            )
            cache[path] = runner.generate(rows, GREEDY)
        return cache[path]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_hybrid", "mtp"])
def test_greedy_logprobs_are_the_same_with_speculation_on_and_off(method, executor, checkpoint_dir, plain):
    path, rows = model_and_prompts(method, checkpoint_dir)
    runner = ModelRunner.from_pretrained(
        path, max_num_seqs=3, speculative=speculative(method, "granite_dense", checkpoint_dir), **EXECUTORS[executor]
    )
    results = runner.generate(rows, GREEDY)
    # The executor asked for ran the steps (MTP drafts read hidden states, which graph steps do not hand out).
    expected_kind = "native" if method == "mtp" and executor == "graph" else executor
    assert runner._scheduler.executor.kind == expected_kind
    stats = runner.spec_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_draft_tokens"] > 0
    if method == "draft_self":
        assert stats["acceptance_rate"] == 1.0  # whole runs of k + 1 tokens from one verification
    for ours, reference in zip(results, plain(path, rows)):
        assert_same_logprobs(ours, reference)


def test_prefix_caching_chunked_prefill_and_a_stop_inside_an_accepted_run(checkpoint_dir):
    """Rows sharing an 80-token prefix, prefilled in chunks of 8 and then from the prefix cache (a second call); row 0
    stops at a token in the middle of a verification's accepted run, whose later tokens and logprobs are dropped."""
    path = str(checkpoint_dir("granite_dense"))
    shared = prompts(8, [80])[0]  # checkpoints lie at multiples of 64
    rows = [shared + tail for tail in prompts(9, [3, 1, 6, 2])]
    plain = ModelRunner.from_pretrained(path, max_num_seqs=3, enable_prefix_caching=False).generate(rows, GREEDY)
    # With k = 3 all accepted, verifications append tokens 1–4, 5–8, …: a stop at an index not a multiple of 4 cuts
    # a run (the first index where the token occurs).
    tokens = plain[0].token_ids
    stop_at = next(j for j in range(1, len(tokens)) if j % 4 and tokens.index(tokens[j]) == j)
    params = [dataclasses.replace(GREEDY, stop_token_ids=(tokens[stop_at],))] + [GREEDY] * 3
    runner = ModelRunner.from_pretrained(
        path,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        speculative=speculative("draft_self", "granite_dense", checkpoint_dir),
    )
    for call in range(2):
        results = runner.generate(rows, params)
        if call == 1:
            assert all(r.num_cached_tokens >= 64 for r in results)  # restored from the cache
        stopped = results[0]
        assert stopped.finish_reason == "stop" and stopped.token_ids == tokens[: stop_at + 1]
        truncated = dataclasses.replace(
            plain[0],
            token_ids=tokens[: stop_at + 1],
            logprobs=plain[0].logprobs[: stop_at + 1],
            cumulative_logprob=sum(e[t] for t, e in zip(tokens[: stop_at + 1], plain[0].logprobs)),
        )
        for ours, reference in zip(results, [truncated, *plain[1:]]):
            assert_same_logprobs(ours, reference)
        # A self-drafting row accepts every draft; row 0's last verification accepted drafts past its stop, dropped.
        assert all(r.num_accepted_draft_tokens == r.num_draft_tokens > 0 for r in results[1:])
        assert 0 < stopped.num_accepted_draft_tokens < stopped.num_draft_tokens


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("method", ["ngram", "draft_hybrid"])
def test_sampled_rows_under_speculation_report_the_target_logprobs_of_their_tokens(
    mode, method, checkpoint_dir, hf_model
):
    """Sampled rows (temperature, top-k, top-p; their tokens differ from plain decoding's) against transformers'
    teacher-forced logits: raw log-softmax, or the float64 processed reference."""
    path = checkpoint_dir("granite_dense")
    spec = speculative(method, "granite_dense", checkpoint_dir)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=4, logprobs_mode=mode, speculative=spec)
    rows = copy_heavy_prompts(1)
    results = runner.generate(rows, PROCESSED_PARAMS)
    assert runner.spec_stats()["num_drafts"] > 0
    for prompt, p, result in zip(rows, PROCESSED_PARAMS, results):
        logits = teacher_forced_logits(hf_model(path), prompt, result.token_ids)
        reference = processed_reference(logits, p) if mode == "processed" else logits.log_softmax(-1)
        assert_logprobs_match(result.token_ids, result.logprobs, reference, p.logprobs)
