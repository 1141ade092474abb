"""The logits options under speculative decoding: every verification position is processed with the drafts before it
counted as generated. Greedy speculative == greedy plain with every option on (n-gram, draft model, MTP; module
path, decode plan, the graph plan's eager form; drafts accepted all, none or some), and sampled speculative keeps the
processed target distribution at a position after an accepted draft (chi-square)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from tests.tiny_models import draft_for
from tests.workers.spec_decode.reference import PatternProposer, last_position_logits
from workers import ModelRunner, SamplingParams, SpeculativeConfig

MAX_TOKENS = 24
NUM_ROWS = 8


def _prompts() -> list[list[int]]:
    """Ragged prompts, half repeating a phrase (n-gram lookup finds matches)."""
    generator = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(NUM_ROWS):
        phrase = torch.randint(4, 128, (3 + i % 4,), generator=generator).tolist()
        prompts.append(phrase * 4 if i % 2 == 0 else phrase + [5, 6])
    return prompts


def _params() -> list[SamplingParams]:
    """Every option on, in varied mixes, and one row without any (its path must stay today's)."""
    base = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    mixes = [
        dict(repetition_penalty=1.6, frequency_penalty=0.6, presence_penalty=0.4),
        dict(frequency_penalty=1.0, logit_bias={9: 2.0, 40: -3.0}),
        dict(presence_penalty=1.5, bad_words=("cat", "big dog")),
        dict(repetition_penalty=1.4, min_tokens=6, logit_bias={2: 4.0}, ignore_eos=False),
        dict(allowed_token_ids=tuple(range(4, 40)), frequency_penalty=0.5),
        dict(),
        dict(repetition_penalty=2.0, min_p=0.3),
        dict(presence_penalty=-0.5, frequency_penalty=0.3, bad_words=("the",)),
    ]
    return [dataclasses.replace(base, **mix) for mix in mixes]


def _speculative(method: str, family: str, checkpoint_dir) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2, policy="fixed")
    if method == "draft":
        draft = draft_for(family, "draft_hybrid")
        return SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir(draft)), policy="fixed")
    return SpeculativeConfig("mtp", 2, policy="fixed")


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, executor",
    [
        ("ngram", "module"),
        ("ngram", "decode_plan"),
        ("ngram", "graph_plan"),
        ("draft", "module"),
        ("draft", "decode_plan"),
        ("mtp", "module"),
        ("mtp", "decode_plan"),
        ("mtp", "graph_plan"),
    ],
)
def test_greedy_speculative_equals_greedy_plain_with_every_option(method, executor, checkpoint_dir):
    family = "qwen3_next" if method == "mtp" else "granite_dense"
    path = str(checkpoint_dir(family))
    options = {"decode_plan": executor == "decode_plan", "cuda_graphs": executor == "graph_plan"}
    prompts, params = _prompts(), _params()
    plain = ModelRunner.from_pretrained(path, max_num_seqs=NUM_ROWS, **options)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    without = [r.token_ids for r in plain.generate(prompts, [_no_options(p) for p in params])]
    assert all(expected[i] != without[i] for i in range(NUM_ROWS) if params[i].has_logits_options), (
        "every option row must change the output, or the comparison proves nothing"
    )
    assert expected[5] == without[5]  # the row without options is untouched by its neighbours' options
    spec = _speculative(method, family, checkpoint_dir)
    runner = ModelRunner.from_pretrained(path, max_num_seqs=NUM_ROWS, speculative=spec, **options)
    results = runner.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    option_rows = [r for r, p in zip(results, params) if p.has_logits_options]
    assert sum(r.num_accepted_draft_tokens for r in option_rows) > 0  # positions after accepted drafts were chosen
    assert len(expected[3]) > 6 and expected[3][-1] == 2  # min_tokens held eos back, then it came


def _no_options(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=params.temperature, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, seed=params.seed
    )


@pytest.mark.parametrize("pattern", ["all", "none", "some"])
def test_options_read_exactly_the_accepted_drafts(pattern, checkpoint_dir):
    path = str(checkpoint_dir("granite_dense"))
    prompts, params = _prompts(), _params()
    base = ModelRunner.from_pretrained(path, max_num_seqs=NUM_ROWS)
    plain = [r.token_ids for r in base.generate(prompts, params)]
    spec = ModelRunner(
        base.model,
        base.tokenizer,
        sorted(base.eos_token_ids),
        proposer=PatternProposer({tuple(p): t for p, t in zip(prompts, plain)}, pattern),
        max_num_seqs=NUM_ROWS,
        speculative=SpeculativeConfig("ngram", 3, policy="fixed"),
    )
    assert [r.token_ids for r in spec.generate(prompts, params)] == plain
    stats = spec.spec_stats()
    if pattern == "all":
        assert stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"] > 0
    elif pattern == "none":
        assert stats["num_accepted_draft_tokens"] == 0 and stats["num_draft_tokens"] > 0
    else:
        assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]


def reference_probs(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams):
    """float64 processed distribution (vLLM's order): logit bias, repetition, frequency and presence penalties over
    `output` (repetition over the prompt too), temperature, top-k."""
    logits = logits.double().clone()
    v = logits.shape[-1]
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v).double()
    seen = (counts > 0) | torch.bincount(torch.tensor(prompt), minlength=v).bool()
    penalty = torch.where(seen, params.repetition_penalty, 1.0).double()
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
    logits = logits / params.temperature
    kth = logits.topk(params.top_k).values[-1]
    return logits.masked_fill(logits < kth, -torch.inf).softmax(-1)


@pytest.mark.slow
def test_sampled_speculative_keeps_the_processed_target_distribution(checkpoint_dir):
    """Chi-square on the third generated token — verification position 1 whenever the first draft was accepted —
    against its exact marginal Σ p̃(t1) p̃(t2 | t1) p̃(t3 | t1, t2), p̃ the processed target (penalties counting the
    tokens before). The target drafts for itself: its q has no penalties (exact all the same, acceptance lower)."""
    path = str(checkpoint_dir("granite_dense"))
    spec = SpeculativeConfig("draft", 2, draft_model=path, policy="fixed")  # itself: q without the penalties
    runner = ModelRunner.from_pretrained(path, max_num_seqs=64, speculative=spec)
    prompt = torch.randint(4, 128, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    options = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5, logit_bias={20: 1.0})
    n = 1200
    params = [
        SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=i, **options) for i in range(n)
    ]
    results = runner.generate([prompt] * n, params)
    assert runner.spec_stats()["num_accepted_draft_tokens"] > n // 10
    p = params[0]
    first = reference_probs(last_position_logits(runner, [prompt])[0], prompt, [], p)
    ones = first.nonzero().flatten().tolist()
    expected = torch.zeros(128, dtype=torch.float64)
    for t1 in ones:
        second = reference_probs(last_position_logits(runner, [prompt + [t1]])[0], prompt, [t1], p)
        twos = second.nonzero().flatten().tolist()
        thirds = last_position_logits(runner, [prompt + [t1, t2] for t2 in twos])
        for t2, logits in zip(twos, thirds):
            expected += first[t1] * second[t2] * reference_probs(logits, prompt, [t1, t2], p)
    counts = torch.bincount(torch.tensor([r.token_ids[2] for r in results]), minlength=128).double()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    observed, expected = counts[support], expected[support] * n
    assert (expected >= 5).all()
    assert chisquare(observed.numpy(), (expected / expected.sum() * observed.sum()).numpy()).pvalue > 1e-3
