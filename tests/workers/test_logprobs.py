"""Logprobs of generated tokens (`SamplingParams.logprobs`) against transformers' log-softmax of the teacher-forced
sequence, on every family; the processed mode against a float64 reference of the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from tests.tiny_models import DENSE_FAMILIES
from workers import ModelRunner, SamplingParams
from workers.config import EngineConfig

# Every family: the tiny_models ones, one of each family kept in its own fixture module, the dense ones.
OTHER_FAMILIES = ["falcon_h1", "kimi_linear", "lfm2", "jamba_moe", "zamba2_abab", "olmo_hybrid"]
EVERY_FAMILY = [*ALL_FAMILIES, *OTHER_FAMILIES, *sorted(DENSE_FAMILIES)]
TOLERANCE = 1e-4


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts of token ids 4 … 127."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=generator).tolist() for n in lengths]


def teacher_forced_logits(hf: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits at each generated position [len(output), v] (float64), from one uncached forward over
    the whole sequence (NOTES §5: explicit position ids; no cache continuation)."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = hf(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0].double()
    return logits[len(prompt) - 1 :]


def assert_logprobs_match(token_ids: list[int], entries: list[dict[int, float]], reference: torch.Tensor, k: int):
    """Each position's entry against the reference logprobs [n, v]: the taken token's value, and a top k (in rank
    order, ties aside) whose values are the reference's; the taken token last unless among them."""
    assert len(entries) == len(token_ids) == len(reference)
    for position, (token, entry, expected) in enumerate(zip(token_ids, entries, reference)):
        where = f"position {position}"
        assert entry[token] == pytest.approx(float(expected[token]), abs=TOLERANCE), where
        top = list(entry.items())[:k]
        assert len(entry) == k + (token not in dict(top)), where
        for token_id, value in top:
            if math.isinf(value):
                assert math.isinf(float(expected[token_id])), where
            else:
                assert value == pytest.approx(float(expected[token_id]), abs=TOLERANCE), where
        kth = float(expected.topk(k).values[-1]) if k else -math.inf
        assert all(float(expected[t]) >= kth - TOLERANCE for t, _ in top), f"{where}: not a top {k}"
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True), where


@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_logprobs_match_transformers_teacher_forced(family, checkpoint_dir, hf_model):
    """Greedy and sampled rows (the logprob reported is the sampled token's), k = 5 and k = 0, 3 prompts through 2
    slots: first tokens from the prefill, the rest from decode steps (the native plan where the family has one)."""
    path = checkpoint_dir(family)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=2)
    rows = prompts(3, [1, 9, 20])
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
    ]
    results = runner.generate(rows, params)
    for prompt, p, result in zip(rows, params, results):
        reference = teacher_forced_logits(hf_model(path), prompt, result.token_ids).log_softmax(-1)
        assert_logprobs_match(result.token_ids, result.logprobs, reference, p.logprobs)
        assert result.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(result.token_ids, result.logprobs)))
    # The logprobs are far from uniform: a model that ignored its input would not match by chance.
    assert torch.tensor([e[t] for t, e in zip(results[0].token_ids, results[0].logprobs)]).std() > 0.05


def processed_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 logprobs of the distribution a row samples from: logits / temperature, the top_k kept, then the
    smallest set of most likely tokens reaching top_p (a token is dropped when those before it reach top_p); a
    greedy row's logits unscaled."""
    if params.temperature == 0:
        return logits.log_softmax(-1)
    scaled = logits / params.temperature
    if params.top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[..., -1:], -math.inf)
    ordered, order = scaled.sort(-1, descending=True)
    probs = ordered.softmax(-1)
    dropped = (probs.cumsum(-1) - probs) >= params.top_p
    scaled = scaled.scatter(-1, order, ordered.masked_fill(dropped, -math.inf))
    return scaled.log_softmax(-1)


PROCESSED_PARAMS = [
    SamplingParams(temperature=0.7, top_k=4, seed=1, max_tokens=6, ignore_eos=True, logprobs=6),  # 2 at -inf
    SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_tokens=6, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=0.5, seed=3, max_tokens=6, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),  # greedy: the raw logprobs
]


def assert_processed(runner: ModelRunner, hf: torch.nn.Module, rows: list[list[int]]) -> None:
    """Every row of PROCESSED_PARAMS against `processed_reference` of transformers' logits."""
    results = runner.generate(rows, PROCESSED_PARAMS)
    for prompt, p, result in zip(rows, PROCESSED_PARAMS, results):
        reference = processed_reference(teacher_forced_logits(hf, prompt, result.token_ids), p)
        assert_logprobs_match(result.token_ids, result.logprobs, reference, p.logprobs)
        assert all(math.isfinite(e[t]) for t, e in zip(result.token_ids, result.logprobs))  # it was sampled
    assert all(sum(math.isinf(v) for v in e.values()) == 2 for e in results[0].logprobs)


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(checkpoint_dir, hf_model):
    path = checkpoint_dir("granite_dense")
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=4, logprobs_mode="processed")
    assert runner.engine_config.sampler.logprobs_mode == "processed_logprobs"
    assert_processed(runner, hf_model(path), prompts(4, [3, 12, 7, 1]))


def test_rows_without_logprobs_get_none_and_k_zero_gets_the_sampled_token_alone(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_dense")), max_num_seqs=4)
    without, alone = runner.generate(
        prompts(5, [4, 6]),
        [SamplingParams(max_tokens=4, seed=1), SamplingParams(max_tokens=4, seed=1, ignore_eos=True, logprobs=0)],
    )
    assert without.logprobs is None and without.cumulative_logprob is None
    assert [list(entry) for entry in alone.logprobs] == [[token] for token in alone.token_ids]
    assert alone.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(alone.token_ids, alone.logprobs)))


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "3"])
def test_bad_logprobs_are_refused_naming_the_allowed_values(value):
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs=.* must be None \(no logprobs\) or an integer in"):
        SamplingParams(logprobs=value)


def test_logprobs_modes_take_vllm_names_and_short_ones_and_refuse_others():
    assert EngineConfig().sampler.logprobs_mode == "raw_logprobs"
    assert EngineConfig().replace(logprobs_mode="processed").sampler.logprobs_mode == "processed_logprobs"
    assert EngineConfig().replace(logprobs_mode="raw_logprobs").sampler.logprobs_mode == "raw_logprobs"
    for bad in ("raw_logits", "processed_logits", "", None):  # vLLM's logits modes are not offered
        with pytest.raises(ValueError, match="logprobs_mode.*must be one of raw_logprobs, processed_logprobs"):
            EngineConfig().replace(logprobs_mode=bad)


@pytest.mark.parametrize("native_kernels", [True, False])
def test_more_logprobs_than_the_vocabulary_holds_gives_the_whole_vocabulary(
    checkpoint_dir, native_kernels, monkeypatch
):
    """k = 20 over a 7-token vocabulary: every token once, in rank order (the
    native kernel and torch's path alike)."""
    from workers import logprobs as logprobs_module

    if not native_kernels:
        monkeypatch.setattr(logprobs_module.native, "loaded", lambda: False)
    logits = torch.randn(2, 1, 7, generator=torch.Generator().manual_seed(0))
    table = logprobs_module._logprobs_table(logits, torch.tensor([[3], [6]]), 20)
    for row in range(2):
        position = table[row, 0].tolist()
        entry = logprobs_module.logprobs_entry([int(t) for t in position[2:22]], position[22:42], 3, position[1])
        reference = logits[row, 0].double().log_softmax(-1)
        assert list(entry) == reference.argsort(descending=True).tolist()
        assert all(abs(entry[t] - reference[t].item()) < 1e-5 for t in entry)
