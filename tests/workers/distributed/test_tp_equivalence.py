"""A model split over two ranks (gloo) generates what the unsplit model generates: every family, greedy tokens
equal over 64 tokens, log-probabilities within 1e-4; expert parallel on and off for the MoE families; speculative
decoding equal to plain decoding and prefix caching on equal to off, within the split model."""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
# Every mixer kind: Mamba2 (g = 1 spanning norm: bamba; grouped: nemotron), GDN + MoE + MTP, Mamba1 + MoE, KDA + MLA,
# short conv + MoE, Falcon-H1's parallel block, Zamba2's shared block, OLMo's full-width qk norm, LFM3's gates.
FAMILIES = ["bamba", "granite_moe", "nemotron_moe", "qwen3_next", "qwen3_5_moe", "jamba_moe", "kimi_linear"]
FAMILIES += ["lfm2_moe", "lfm3", "falcon_h1", "zamba2_lora", "olmo_hybrid"]
# The other layouts of the tiny fixtures: dense variants, biases, no norm, untied heads, low-rank q, RoPE, ABAB.
FAMILIES += ["granite_dense", "nemotron_dense", "qwen3_5", "falcon_h1_biases", "falcon_h1_no_norm"]
FAMILIES += ["kimi_linear_dense", "kimi_linear_qlora", "kimi_linear_wide", "lfm2", "lfm2_untied", "jamba_dense"]
FAMILIES += ["olmo_hybrid_rope", "zamba2_abab"]
MOE_FAMILIES = ["granite_moe", "nemotron_moe", "qwen3_next", "qwen3_5_moe", "jamba_moe", "lfm2_moe", "kimi_linear"]


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Three prompts of different lengths (ragged rows), a phrase repeated so that n-gram lookup finds drafts."""
    generator = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(4, min(vocab, 128), (n,), generator=generator).tolist() for n in (3, 5, 4)]
    return [phrase * 3 for phrase in phrases]


def run(path: str, size: int, **options) -> list:
    """Greedy results of `prompts` on a runner split over `size` ranks (closed afterwards)."""
    runner = ModelRunner.from_pretrained(path, max_num_seqs=4, tensor_parallel_size=size, **options)
    try:
        return runner.generate(prompts(runner.config.vocab_size), GREEDY)
    finally:
        runner.close()


def assert_equal_generation(split: list, whole: list) -> None:
    """Same tokens; at every position the same top entries, values within TOLERANCE."""
    for ours, expected in zip(split, whole, strict=True):
        assert ours.token_ids == expected.token_ids
        for position, (entry, reference) in enumerate(zip(ours.logprobs, expected.logprobs, strict=True)):
            assert set(entry) == set(reference), f"position {position}"
            for token, value in reference.items():
                assert entry[token] == pytest.approx(value, abs=TOLERANCE), f"position {position}"


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_generate_what_one_does(checkpoint_dir, family: str) -> None:
    path = str(checkpoint_dir(family))
    assert_equal_generation(run(path, 2), run(path, 1))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_parallel_generates_what_one_rank_does(checkpoint_dir, family: str) -> None:
    path = str(checkpoint_dir(family))
    assert_equal_generation(run(path, 2, enable_expert_parallel=True), run(path, 1))


@pytest.mark.parametrize(("family", "method"), [("granite_moe", "ngram"), ("bamba", "draft"), ("qwen3_next", "mtp")])
def test_speculative_equals_plain_when_split(checkpoint_dir, family: str, method: str) -> None:
    """n-gram lookup, a draft model (whole, on rank 0) and the split MTP head."""
    speculative = {
        "ngram": SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed"),
        "draft": SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(family)), policy="fixed"),
        "mtp": SpeculativeConfig("mtp", 2, policy="fixed"),
    }[method]
    path = str(checkpoint_dir(family))
    spec = run(path, 2, speculative=speculative)
    assert sum(result.num_accepted_draft_tokens for result in spec) > 0, "drafts were accepted"
    assert [r.token_ids for r in spec] == [r.token_ids for r in run(path, 2)]


@pytest.mark.parametrize("family", ["granite_moe", "qwen3_next"])
def test_prefix_cache_on_equals_off_when_split(checkpoint_dir, family: str) -> None:
    """Rows of one 149-token template (a checkpoint at 64 tokens fits), chunked prefill at 64 tokens a step."""
    from tests.workers.test_prefix_cache import _templated

    path, requests = str(checkpoint_dir(family)), _templated(149, num_rows=5)
    results = {}
    for caching in (False, True):
        runner = ModelRunner.from_pretrained(
            path, max_num_seqs=4, tensor_parallel_size=2, enable_prefix_caching=caching, max_num_batched_tokens=64
        )
        try:
            results[caching] = runner.generate(requests, GREEDY)
        finally:
            runner.close()
    assert [r.num_cached_tokens for r in results[True]] == [0] + [128] * 4, "every row after the first restores"
    assert_equal_generation(results[True], results[False])


@pytest.mark.parametrize("family", ["nemotron_moe", "kimi_linear"])
def test_split_scores_are_the_unsplit_ones(checkpoint_dir, family: str) -> None:
    path = str(checkpoint_dir(family))
    sequences = prompts(100, seed=3)
    scores = {}
    for size in (1, 2):
        runner = ModelRunner.from_pretrained(path, tensor_parallel_size=size)
        try:
            scores[size] = runner.score(sequences)
        finally:
            runner.close()
    for split, whole in zip(scores[2], scores[1], strict=True):
        assert split.error is None and len(split.token_logprobs) == len(whole.token_logprobs)
        assert split.token_logprobs == pytest.approx(whole.token_logprobs, abs=TOLERANCE)
