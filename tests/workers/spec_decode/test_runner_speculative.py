"""Speculative decoding through the runner: sampled exactness, truncation mid-run, config errors, metrics."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from tests.workers.spec_decode.reference import last_position_logits
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.sampling import target_probs
from workers.spec_decode.ngram import NgramIndex, propose_ngram
from workers.spec_decode.rejection_sampler import rejection_sample


def _next_token_probs(runner: ModelRunner, sequences: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution after each sequence, from one plain forward."""
    return torch.stack([target_probs(row, params) for row in last_position_logits(runner, sequences)]).double()


@pytest.fixture(scope="module")
def near_draft(checkpoint_dir, tmp_path_factory):
    """The target with its weights perturbed: a draft whose q overlaps p without equalling it."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near_draft") / "model"
    shutil.copytree(checkpoint_dir("granite_moe"), path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}, path / "model.safetensors")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_speculative_tokens_follow_the_target_distribution(method, checkpoint_dir, near_draft):
    """Chi-square on the second generated token (the first one a speculative step produces)."""
    if method == "draft":
        spec = SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=str(near_draft), policy="fixed")
    else:
        spec = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=1, policy="fixed")
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_moe")), max_num_seqs=64, speculative=spec)
    # Every vocabulary token occurs in the prompt, so an n-gram lookup always finds a draft.
    prompt = torch.randperm(128, generator=torch.Generator().manual_seed(0)).tolist()
    n = 1500
    params = [SamplingParams(temperature=1.0, top_k=16, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)]
    results = runner.generate([prompt] * n, params)
    assert runner.spec_stats()["num_drafts"] >= n
    assert 0 < runner.spec_stats()["acceptance_rate"] < 1  # both accepted and recovered tokens are exercised
    assert_second_tokens_follow_the_target(runner, prompt, params[0], [r.token_ids[1] for r in results])


def assert_second_tokens_follow_the_target(
    runner: ModelRunner, prompt: list[int], params: SamplingParams, second_tokens: list[int]
) -> None:
    """Chi-square of the second generated tokens against their exact marginal under the target."""
    n = len(second_tokens)
    # Exact marginal of token 2: Σ_t1 p(t1 | prompt) · p(t2 | prompt, t1).
    first = _next_token_probs(runner, [prompt], params)[0]
    candidates = first.nonzero().flatten().tolist()
    second = _next_token_probs(runner, [prompt + [t] for t in candidates], params)
    expected = (first[candidates, None] * second).sum(0)
    counts = torch.bincount(torch.tensor(second_tokens), minlength=128).double()
    assert counts[expected == 0].sum() == 0
    expected = expected * n
    # Pool the rare tokens into one bin so that every bin expects at least 5 counts.
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare & (expected > 0)].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    expected = expected / expected.sum() * observed.sum()  # scipy wants equal float64 totals
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens", "stop_string"])
def test_stops_in_the_middle_of_an_accepted_run_truncate_like_plain(stop, checkpoint_dir):
    path = str(checkpoint_dir("bamba"))
    plain_runner = ModelRunner.from_pretrained(path)
    spec = SpeculativeConfig("draft", 4, draft_model=path, policy="fixed")
    spec_runner = ModelRunner.from_pretrained(path, speculative=spec)
    prompt = plain_runner.tokenizer.encode("the cat sat on the mat")
    free = plain_runner.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    if stop == "eos":
        spec_runner.eos_token_ids = plain_runner.eos_token_ids = frozenset({free.token_ids[6]})
        params = SamplingParams(temperature=0, max_tokens=30)
    elif stop == "stop_token":
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free.token_ids[6]])
    elif stop == "max_tokens":
        params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    else:
        word = next(w for w in free.text.split()[2:] if w)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[word])
    plain = plain_runner.generate([prompt], params)[0]
    spec = spec_runner.generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) < 30
    assert (spec.finish_reason, spec.text) == (plain.finish_reason, plain.text)
    # Counters count what was kept: accepted drafts after the stop are dropped and not counted.
    expected = _self_draft_counts(len(spec.token_ids), 4, params.max_tokens)
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_draft_tokens) == expected


def _self_draft_counts(num_tokens: int, k: int, max_tokens: int) -> tuple[int, int, int]:
    """(num_drafts, num_draft_tokens, kept accepted drafts) when the draft is the target itself under greedy:
    every draft is accepted, each step appends its drafts and the bonus token until the request stops."""
    produced, drafts, draft_tokens, accepted = 1, 0, 0, 0  # token 0 comes from the prefill
    while produced < num_tokens:
        budget = min(k, max_tokens - produced - 1)  # drafts never go past max_tokens
        appended = min(budget + 1, num_tokens - produced)
        if budget:
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + budget, accepted + min(budget, appended)
        produced += appended
    return drafts, draft_tokens, accepted


@pytest.mark.parametrize("method,family", [("draft", "bamba"), ("mtp", "qwen3_5")])
def test_draft_probabilities_stay_on_the_device_and_reach_the_sampler_there(
    method, family, checkpoint_dir, monkeypatch
):
    """Every tensor the rejection sampler receives is on the runner's device, and the draft side makes no host
    copies of its distributions (on CUDA those would meet the target's probabilities on another device)."""
    import workers.scheduler

    path = str(checkpoint_dir(family))
    draft = path if method == "draft" else None
    runner = ModelRunner.from_pretrained(
        path, speculative=SpeculativeConfig(method, 3, draft_model=draft, policy="fixed")
    )
    seen = []

    def checked(draft_token_ids, target_logits, draft_probs, params, generators):
        seen.append({t.device for t in (draft_token_ids, target_logits, draft_probs) if t is not None})
        return rejection_sample(draft_token_ids, target_logits, draft_probs, params, generators)

    def no_host_copy(tensor, *args, **kwargs):
        raise AssertionError("a host copy (.cpu()) in a speculative step")

    monkeypatch.setattr(workers.scheduler.RejectionSampler, "__call__", staticmethod(checked))
    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    results = runner.generate([[5, 6, 7], [8, 9]], params)
    assert all(r.num_draft_tokens > 0 for r in results)
    assert seen and all(devices == {runner.device} for devices in seen)


def test_rejection_sampler_refuses_inputs_on_another_device():
    logits = torch.zeros(1, 2, 8)
    with pytest.raises(AssertionError, match="target's device"):
        rejection_sample(
            torch.zeros(1, 1, dtype=torch.long),
            logits,
            torch.zeros(1, 1, 8, device="meta"),
            [SamplingParams(temperature=1.0)],
            [torch.Generator()],
        )


def test_metrics_per_request_and_per_runner(checkpoint_dir):
    path = str(checkpoint_dir("nemotron_dense"))
    runner = ModelRunner.from_pretrained(
        path, speculative=SpeculativeConfig("draft", 3, draft_model=path, policy="fixed")
    )
    results = runner.generate([[5, 6, 7], [9] * 5], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    stats = runner.spec_stats()
    # Self-drafting under greedy: every draft is accepted; 12 tokens after the first come in 3 steps of 4.
    assert [(r.num_drafts, r.num_draft_tokens, r.num_accepted_draft_tokens) for r in results] == [(3, 9, 9)] * 2
    assert stats["acceptance_rate"] == 1.0 and stats["mean_accepted_length"] == 4.0
    assert stats["acceptance_per_position"] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("method, family", [("draft", "nemotron_dense"), ("mtp", "qwen3_5")])
def test_a_proposer_catching_up_on_a_prompt_is_not_timed_as_a_step(method, family, checkpoint_dir):
    """The first verification of each request makes a draft model (or an MTP head) feed its whole prompt first:
    that step's time is a prefill's, not a draft step's, so the policy does not learn from it (acceptance it does
    learn). (With prefix caching an MTP head consumes the prompt at prefill, before its blocks are shared: then
    the first verification is a plain draft step, timed.)"""
    path = str(checkpoint_dir(family))
    draft = path if method == "draft" else None
    runner = ModelRunner.from_pretrained(
        path,
        max_num_seqs=1,
        speculative=SpeculativeConfig(method, 3, draft_model=draft, policy="fixed"),
        enable_prefix_caching=False,
    )
    observed = []
    observe = runner._policy.observe
    runner._policy.observe = lambda ids, asked, accepted, seconds, width=None: (
        observed.append((ids[0], max(asked), seconds)),
        observe(ids, asked, accepted, seconds, width),
    )
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    runner.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13], [9] * 10], params)  # one at a time, each from nothing
    for request in (0, 1):
        steps = [(asked, seconds) for rid, asked, seconds in observed if rid == request]
        assert steps[0][0] == 3 and steps[0][1] is None  # caught up on the prompt: untimed
        assert all(seconds is not None for _, seconds in steps[1:]) and len(steps) > 1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(method="eagle"), "method='eagle'"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens=0"),
        (dict(method="draft"), "draft_model is required"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min=0"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max=2"),
    ],
)
def test_invalid_speculative_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_draft_with_another_vocabulary_is_refused(tmp_path, checkpoint_dir):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(checkpoint_dir("draft_attention"), other)
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["cat"], vocab["model"]["vocab"]["dog"] = (
        vocab["model"]["vocab"]["dog"],
        vocab["model"]["vocab"]["cat"],
    )
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="different tokenizer vocabulary"):
        ModelRunner.from_pretrained(
            str(checkpoint_dir("bamba")), speculative=SpeculativeConfig("draft", draft_model=str(other))
        )


def test_ngram_lookup():
    context = [1, 2, 3, 4, 9, 1, 2, 3]
    assert propose_ngram(context, 3, 1, 3) == [4, 9, 1]  # longest suffix [1, 2, 3] matched
    assert propose_ngram(context, 7, 1, 3) == [4, 9, 1, 2, 3, 4, 9]  # on through the copy's own output
    assert propose_ngram([7, 5, 8, 5, 8], 4, 1, 2) == [5, 8, 5, 8]  # a loop of period 2 repeats its period
    assert propose_ngram([3, 3, 3], 3, 1, 1) == [3, 3, 3]
    assert propose_ngram([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats: no drafts
    assert propose_ngram([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]  # most recent match wins
    assert propose_ngram([4, 4], 2, 2, 3) == []  # too short for a 2-gram plus a continuation


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 5), (1, 3)])
def test_ngram_index_proposes_what_the_scan_does(min_n, max_n):
    """The incremental index the proposer keeps per request against the plain scan, token by token as a request
    grows (a small vocabulary makes matches, loops and near-misses common)."""
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        new, tokens, index = [rng.randrange(4) for _ in range(rng.randrange(1, 6))], [], NgramIndex(min_n, max_n)
        for _ in range(60):
            index.extend(new)
            tokens += new
            k = rng.randrange(0, 6)
            assert index.propose(k) == propose_ngram(tokens, k, min_n, max_n), tokens
            new = [rng.randrange(4) for _ in range(rng.choice([1, 1, 1, 3]))]


def test_speculation_in_bfloat16_on_cpu_warns_only_on_the_all_torch_path(checkpoint_dir, caplog):
    """The all-PyTorch bfloat16 model rounds verification and decode matmuls differently: a warning. float32, and
    bfloat16 weights on the native kernels (float32 activations, one kernel path per process) are token-exact."""
    path = str(checkpoint_dir("granite_dense"))
    with caplog.at_level("WARNING", logger="workers.runner"):
        ModelRunner.from_pretrained(
            path, dtype="bfloat16", linear_backend="torch", speculative=SpeculativeConfig("ngram")
        )
    assert "float32 (dtype 'auto' on CPU) is token-exact" in caplog.text
    for options in ({}, {"dtype": "bfloat16"}):
        caplog.clear()
        with caplog.at_level("WARNING", logger="workers.runner"):
            ModelRunner.from_pretrained(path, speculative=SpeculativeConfig("ngram"), **options)
        assert "token-exact" not in caplog.text
