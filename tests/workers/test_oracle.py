"""hybridgen against transformers' own modeling code on tiny random checkpoints of every family."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from workers import ModelRunner, SamplingParams

PROMPT_LENGTHS = [1, 3, 8, 15, 16, 17, 29, 40]  # around and across the SSD chunk size (16)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=generator).tolist() for n in lengths]


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = hf(ids, position_ids=torch.arange(len(tokens))[None]).logits.float()
    return logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_score_matches_transformers(family, checkpoint_dir, hf_model):
    path = checkpoint_dir(family)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=4)
    sequences = _prompts(1, [2, 9, 16, 33, 48, 5])
    scores = runner.score(sequences)
    worst = 0.0
    for seq, score in zip(sequences, scores):
        assert score.error is None
        reference = _hf_logprobs(hf_model(path), seq)
        assert len(score.token_logprobs) == len(seq) - 1
        worst = max(worst, (torch.tensor(score.token_logprobs) - reference).abs().max().item())
    print(f"{family}: max |Δ logprob| = {worst:.2e}")
    assert worst < 1e-4
    # The logprobs are far from uniform: the test would notice a model that ignores its input.
    assert torch.tensor(scores[3].token_logprobs).std() > 0.3


def _hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the top-2 logit margin at each step."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), margins


def assert_same_greedy(ours: list[int], reference: list[int], margins: list[float]) -> None:
    """Token for token, except that a near-tie (top-2 margin < 1e-4) may legitimately flip and end the comparison."""
    for step, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            assert margins[step] < 1e-4, f"step {step}: ours {a}, transformers {b} (margin {margins[step]:.2e})"
            return
    assert len(ours) == len(reference)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_greedy_generate_matches_transformers(family, checkpoint_dir, hf_model):
    path = checkpoint_dir(family)
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=3)  # 8 prompts through 3 slots: slots get reused
    prompts = _prompts(2, PROMPT_LENGTHS)
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and result.error is None
        reference, margins = _hf_greedy(hf_model(path), prompt, 10)
        assert_same_greedy(result.token_ids, reference, margins)
