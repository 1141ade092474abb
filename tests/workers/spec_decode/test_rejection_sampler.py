"""The rejection sampler: the placeholder layout, greedy rules, and exactness of the sampled distribution."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from workers import SamplingParams
from workers.spec_decode import PLACEHOLDER_TOKEN_ID, num_accepted_tokens, rejection_sample
from workers.spec_decode.proposal import Proposal

GREEDY = SamplingParams(temperature=0)


def _greedy_logits(targets: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax at position j of row i is targets[i][j]."""
    width = max(len(t) for t in targets)
    logits = torch.zeros(len(targets), width, vocab)
    for i, row in enumerate(targets):
        for j, token in enumerate(row):
            logits[i, j, token] = 5.0
    return logits


def test_greedy_accepts_until_first_mismatch_then_corrects():
    drafts = Proposal.from_lists([[3, 4, 5], [3, 9, 5], [7, 1, 1], []], None).token_ids
    logits = _greedy_logits([[3, 4, 5, 6], [3, 4, 5, 6], [2, 1, 1, 1], [8, 0, 0, 0]])
    out = rejection_sample(drafts, logits, None, [GREEDY] * 4, [torch.Generator()] * 4)
    P = PLACEHOLDER_TOKEN_ID
    assert out.tolist() == [[3, 4, 5, 6], [3, 4, P, P], [2, P, P, P], [8, P, P, P]]
    assert num_accepted_tokens(out).tolist() == [4, 2, 1, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=8))
def test_valid_tokens_are_contiguous_and_counted(rows):
    """For random (k, accepted) patterns: valid tokens contiguous from column 0, count = index of the first −1."""
    rows = [(k, min(a, k)) for k, a in rows]
    targets = [[(j * 3 + i) % 10 for j in range(7)] for i in range(len(rows))]
    drafts = [t[:a] + [(t[a] + 1) % 10] * (k - a) for t, (k, a) in zip(targets, rows)]
    proposal = Proposal.from_lists(drafts, None)
    logits = _greedy_logits([t[: proposal.token_ids.shape[1] + 1] for t in targets])
    out = rejection_sample(proposal.token_ids, logits, None, [GREEDY] * len(rows), [torch.Generator()] * len(rows))
    counts = num_accepted_tokens(out)
    for row, (_, a) in zip(out.tolist(), rows):
        first_placeholder = row.index(PLACEHOLDER_TOKEN_ID) if PLACEHOLDER_TOKEN_ID in row else len(row)
        assert all(t == PLACEHOLDER_TOKEN_ID for t in row[first_placeholder:])
        assert all(t != PLACEHOLDER_TOKEN_ID for t in row[:first_placeholder])
        assert first_placeholder == a + 1
    assert counts.tolist() == [a + 1 for _, a in rows]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=4), min_size=1, max_size=6), st.integers(0, 1000))
def test_greedy_rows_on_the_device_equal_the_row_by_row_rule(drafts, seed):
    """All-greedy batches take `greedy_accept` (no host round trip); a batch with one sampled request takes the
    row-by-row loop: its greedy rows must come out the same."""
    proposal = Proposal.from_lists(drafts, None)
    logits = torch.randn(len(drafts), proposal.token_ids.shape[1] + 1, 4, generator=torch.Generator().manual_seed(seed))
    generators = [torch.Generator().manual_seed(i) for i in range(len(drafts) + 1)]
    on_device = rejection_sample(proposal.token_ids, logits, None, [GREEDY] * len(drafts), generators[:-1])
    mixed_drafts = torch.cat([proposal.token_ids, torch.full((1, proposal.token_ids.shape[1]), PLACEHOLDER_TOKEN_ID)])
    sampled = SamplingParams(temperature=1.0)
    row_by_row = rejection_sample(
        mixed_drafts, torch.cat([logits, logits[:1]]), None, [GREEDY] * len(drafts) + [sampled], generators
    )
    assert on_device.tolist() == row_by_row[:-1].tolist()


def _first_token_distribution(q: torch.Tensor | None, draft_token: int, p_logits: torch.Tensor, n: int, params):
    """Empirical distribution of the first output token over n independent verifications of one draft."""
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    if q is None:
        draft = torch.full((n, 1), draft_token)
    else:
        draft = torch.multinomial(q.float(), n, replacement=True, generator=torch.Generator().manual_seed(7))[:, None]
    logits = p_logits.expand(n, 2, -1)
    probs = None if q is None else q.float().expand(n, 1, -1)
    out = rejection_sample(draft, logits, probs, [params] * n, generators)
    return torch.bincount(out[:, 0], minlength=p_logits.shape[-1]).double()


def test_sampled_output_distribution_is_the_target_distribution():
    """Chi-square: whatever the draft distribution q (or an n-gram's fixed draft), tokens follow p."""
    n = 6000
    params = SamplingParams(temperature=0.9, top_k=5)
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]] * 2)
    p = torch.softmax(p_logits[0].double() / 0.9, -1)
    p[p.argsort()[0]] = 0  # top_k=5 drops the smallest
    p = p / p.sum()
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.1, 0.1], dtype=torch.float64)
    for draft_q, draft_token in [(q, None), (None, 1), (None, 3)]:
        counts = _first_token_distribution(draft_q, draft_token, p_logits, n, params)
        assert counts[p == 0].sum() == 0
        support = p > 0
        result = chisquare(counts[support].numpy(), (p[support] * counts.sum()).numpy())
        assert result.pvalue > 1e-3, (draft_q, draft_token, counts, p * n)
    # The test has power: sampling from q instead of p is rejected.
    wrong = chisquare((q[p > 0] / q[p > 0].sum() * n).numpy(), (p[p > 0] * n).numpy())
    assert wrong.pvalue < 1e-6
