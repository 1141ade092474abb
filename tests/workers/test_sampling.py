"""The sampler's draw (`workers/sampling.py`): exactly the distribution it is given, one random stream per row."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from workers.sampling import SamplingBatch, SamplingParams, sample, sample_from, sample_rows, target_probs


def _expected(probs: torch.Tensor, n: int):
    """Expected counts in float64 (they must add up to n to chi-square's tolerance)."""
    probs = probs.double()
    return (probs / probs.sum() * n).numpy()


def test_sample_rows_follow_the_distribution_and_never_draw_a_zero_weight():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = [sample_from(probs, generator) for _ in range(6000)]
    counts = torch.bincount(torch.tensor(draws), minlength=6)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert chisquare(counts[support].numpy(), _expected(probs[support], len(draws))).pvalue > 1e-3
    # A wrong distribution is told apart at this sample size (the test can fail).
    wrong = torch.tensor([0.3, 0.5, 0.2])
    assert chisquare(counts[support].numpy(), _expected(wrong, len(draws))).pvalue < 1e-6


def test_unnormalised_weights_and_edges():
    generator = torch.Generator().manual_seed(1)
    assert {sample_from(torch.tensor([0.0, 0.0, 7.0]), generator) for _ in range(50)} == {2}
    assert {sample_from(torch.tensor([3.0, 0.0, 0.0]), generator) for _ in range(50)} == {0}
    assert sample_rows(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), [generator, generator]) == [0, 1]


def test_a_row_draws_the_same_whatever_else_is_in_the_batch():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=0), SamplingParams(top_p=0.9)]
    params += [SamplingParams(temperature=1.3), SamplingParams(temperature=0.7, top_k=50)]

    def run(rows: list[int]) -> list[int]:
        generators = [torch.Generator().manual_seed(100 + row) for row in rows]
        batch = SamplingBatch([params[row] for row in rows], generators)
        return [sample(logits[rows], batch) for _ in range(20)]

    together = run(list(range(5)))
    for row in range(5):
        alone = run([row])
        assert [step[row] for step in together] == [step[0] for step in alone]


def test_sampled_rows_follow_their_processed_distribution():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    probs = target_probs(logits[0], params)
    batch = SamplingBatch([params], [torch.Generator().manual_seed(4)])
    draws = torch.tensor([sample(logits, batch)[0] for _ in range(5000)])
    counts = torch.bincount(draws, minlength=40)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert chisquare(counts[support].numpy(), _expected(probs[support], 5000)).pvalue > 1e-3


def test_a_uniform_rounding_up_to_the_total_still_draws_a_token_of_weight(monkeypatch):
    """u · total can round up to the total (u = 1 − 2^-53); the draw is then the last token of positive weight, not
    the last token."""
    probs = torch.tensor([[0.1, 0.9, 0.0, 0.0], [0.3, 0.3, 0.4, 0.0]], dtype=torch.float64)
    almost_one = torch.tensor(1.0 - 2.0**-53, dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: almost_one)
    assert sample_rows(probs * 3, [torch.Generator(), torch.Generator()]) == [1, 2]
