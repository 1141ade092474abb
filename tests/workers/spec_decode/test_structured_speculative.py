"""Structured outputs under speculative decoding: every method and executor keeps greedy output equal to plain
greedy under every constraint kind, every stopped row valid, the matcher following the state shift whatever was
accepted, and sampled rows distributed as the masked target (chi-square)."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from tests.workers.spec_decode.reference import PatternProposer, last_position_logits
from tests.workers.structured_fixtures import ascii_checkpoint, random_regex, random_schema
from tests.workers.test_structured_outputs import assert_valid, random_prompts
from workers import ModelRunner, SamplingParams, SpeculativeConfig, StructuredOutputsParams
from workers.sampling import target_probs

NUM_ROWS = 64
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def ascii_models(tmp_path_factory):
    """family → a tiny random checkpoint with the ASCII tokenizer (built on first use)."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = ascii_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def mixed_constraints(rng: random.Random, n: int) -> list[StructuredOutputsParams]:
    """n constraints cycling through the four kinds."""
    makers = [
        lambda: StructuredOutputsParams(json=random_schema(rng)),
        lambda: StructuredOutputsParams(regex=random_regex(rng)),
        lambda: StructuredOutputsParams(choice=rng.sample(["cat", "dog", "a cat", "42", "null"], 3)),
        lambda: StructuredOutputsParams(grammar='root ::= "[" item ("," item)* "]"\nitem ::= [a-d]+ | [0-9]'),
    ]
    return [makers[i % len(makers)]() for i in range(n)]


def spec_config(method: str, ascii_models) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")
    if method == "draft":
        return SpeculativeConfig("draft", 3, draft_model=str(ascii_models("draft_hybrid")), policy="fixed")
    return SpeculativeConfig("mtp", 2, policy="fixed")


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, family, decode_plan",
    [
        ("ngram", "granite_dense", False),
        ("ngram", "granite_dense", True),
        ("draft", "granite_dense", False),
        ("draft", "granite_dense", True),
        ("mtp", "qwen3_next", False),
        ("mtp", "qwen3_next", True),
    ],
)
def test_speculative_greedy_equals_plain_and_every_stop_is_valid(method, family, decode_plan, ascii_models):
    """64 rows of the four constraint kinds, half greedy (compared with plain greedy token for token), half
    sampled (checked for validity)."""
    path = str(ascii_models(family))
    rng = random.Random(hash((method, decode_plan)) % 1000)
    constraints = mixed_constraints(rng, NUM_ROWS)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=i % 2, seed=i, structured_outputs=c)
        for i, c in enumerate(constraints)
    ]
    prompts = random_prompts(rng, NUM_ROWS)
    plain = ModelRunner.from_pretrained(path, max_num_seqs=NUM_ROWS, decode_plan=decode_plan)
    spec = ModelRunner.from_pretrained(
        path, max_num_seqs=NUM_ROWS, decode_plan=decode_plan, speculative=spec_config(method, ascii_models)
    )
    expected = plain.generate(prompts, params)
    results = spec.generate(prompts, params)
    for row in range(0, NUM_ROWS, 2):  # the greedy rows
        assert results[row].token_ids == expected[row].token_ids, (row, constraints[row])
    assert_valid(results, constraints, min_stops=NUM_ROWS // 2)
    stats = spec.spec_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] > 0


@pytest.mark.parametrize("pattern", ["all", "none", "some"])
def test_the_matcher_follows_the_state_shift(pattern, ascii_models):
    """Whatever is accepted, the output equals plain greedy and stays valid: the matcher advanced by exactly the
    appended tokens (a matcher advanced by rejected drafts would mask the next step wrongly or fail)."""
    path = str(ascii_models("granite_dense"))
    rng = random.Random(11)
    constraints = mixed_constraints(rng, 16)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=c) for c in constraints]
    prompts = random_prompts(rng, 16)
    base = ModelRunner.from_pretrained(path, max_num_seqs=16)
    plain = base.generate(prompts, params)
    reference = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    spec = ModelRunner(
        base.model,
        base.tokenizer,
        sorted(base.eos_token_ids),
        proposer=PatternProposer(reference, pattern),
        max_num_seqs=16,
        speculative=SpeculativeConfig("ngram", 3, policy="fixed"),
    )
    results = spec.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    stats = spec.spec_stats()
    if pattern == "all":
        assert stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"] > 0
    elif pattern == "none":
        assert stats["num_accepted_draft_tokens"] == 0 and stats["num_draft_tokens"] > 0
    else:
        assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]
    assert_valid(results, constraints, min_stops=8)


def _masked_next_probs(runner, compiled, prompt, prefixes, params):
    """The masked target's sampling distribution after prompt + each prefix (a fresh forward and a fresh
    xgrammar matcher per prefix: independent of the runner's step code)."""
    import xgrammar

    logits = last_position_logits(runner, [prompt + p for p in prefixes])
    bitmask = xgrammar.allocate_token_bitmask(len(prefixes), runner.config.vocab_size)
    for row, prefix in enumerate(prefixes):
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=[2])
        assert all(matcher.accept_token(t) for t in prefix)
        matcher.fill_next_token_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=runner.config.vocab_size)
    return torch.stack([target_probs(row, params) for row in logits]).double()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_speculative_keeps_the_masked_target_distribution(method, ascii_models):
    """Chi-square on the second generated token (the first a speculative step produces) against its exact marginal
    under the masked target: Σ_t1 p̃(t1 | prompt) p̃(t2 | prompt, t1), p̃ the grammar-masked distribution."""
    import xgrammar

    path = str(ascii_models("granite_dense"))
    if method == "draft":
        spec = SpeculativeConfig("draft", 2, draft_model=str(ascii_models("draft_hybrid")), policy="fixed")
    else:
        spec = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=1, policy="fixed")
    runner = ModelRunner.from_pretrained(path, max_num_seqs=64, speculative=spec)
    regex = "[a-h0-9][a-p0-9]{30}"  # never complete within 3 tokens
    constraint = StructuredOutputsParams(regex=regex)
    prompt = torch.randperm(124, generator=torch.Generator().manual_seed(0)).add(4).tolist()  # every n-gram drafts
    n = 800
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i, structured_outputs=constraint) for i in range(n)]
    results = runner.generate([prompt] * n, params)
    assert runner.spec_stats()["num_drafts"] >= n // 5  # many n-gram drafts are cut: the grammar rejects them
    assert 0 < runner.spec_stats()["acceptance_rate"] < 1
    info = xgrammar.TokenizerInfo.from_huggingface(runner.tokenizer, vocab_size=runner.config.vocab_size)
    compiled = xgrammar.GrammarCompiler(info).compile_regex(regex)
    first = _masked_next_probs(runner, compiled, prompt, [[]], params[0])[0]
    candidates = first.nonzero().flatten().tolist()
    second = _masked_next_probs(runner, compiled, prompt, [[t] for t in candidates], params[0])
    expected = (first[candidates, None] * second).sum(0) * n
    counts = torch.bincount(torch.tensor([r.token_ids[1] for r in results]), minlength=128).double()
    assert counts[expected == 0].sum() == 0  # never a token the grammar forbids
    rare = (expected < 5) & (expected > 0)  # pooled into one bin so that every bin expects at least 5 counts
    common = expected >= 5
    observed = torch.cat([counts[common], counts[rare].sum()[None]]) if rare.any() else counts[common]
    expected = torch.cat([expected[common], expected[rare].sum()[None]]) if rare.any() else expected[common]
    expected = expected / expected.sum() * observed.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
