"""The native logprobs kernel (`csrc/logprobs.c`) against torch's log_softmax, gather and topk."""

from __future__ import annotations

import pytest
import torch

from workers.model.kernels import native


def _reference(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = logits.double().log_softmax(-1)
    return logprobs.gather(-1, tokens[:, None])[:, 0], logprobs.topk(k, dim=-1).values if k else logprobs[:, :0]


@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 1000, 32003])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_match_torch_at_every_width(n, k):
    k = min(k, n)
    g = torch.Generator().manual_seed(n * 31 + k)
    logits = torch.randn(6, n, generator=g) * 4
    logits[1] *= 30  # a peaked row: exp underflows for most entries
    logits[2] += 1000  # large offsets: the maximum is subtracted before exp
    tokens = torch.randint(0, n, (6,), generator=g)
    token_logprobs, top_ids, top_logprobs = native.logprobs(logits, tokens, k)
    want_token, want_top = _reference(logits, tokens, k)
    torch.testing.assert_close(token_logprobs.double(), want_token, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(top_logprobs.double(), want_top, atol=2e-5, rtol=1e-5)
    # The ids are those of the values: the top k of distinct random values are unique.
    assert torch.equal(top_ids, logits.topk(k, dim=-1).indices)


def test_ties_rank_the_lower_index_first_and_masked_tokens_never_rank():
    logits = torch.full((3, 50), -float("inf"))
    logits[0, [3, 9, 40]] = 2.0  # a three-way tie
    logits[0, 20] = 5.0
    logits[1, [10, 11]] = 0.0  # two finite values, three asked: the third is the row's first −inf entry
    logits[2] = torch.arange(50.0)  # increasing: the top ids are the last ones, largest first
    tokens = torch.tensor([9, 11, 0])
    token_logprobs, top_ids, top_logprobs = native.logprobs(logits, tokens, 3)
    assert top_ids.tolist() == [[20, 3, 9], [10, 11, 0], [49, 48, 47]]
    assert top_logprobs[1, 2] == -float("inf")
    want_token, _ = _reference(logits, tokens, 0)
    torch.testing.assert_close(token_logprobs.double(), want_token, atol=2e-5, rtol=1e-5)


def test_more_asked_than_the_vocabulary_holds():
    logits = torch.tensor([[0.5, -float("inf"), 2.0]])
    _, top_ids, top_logprobs = native.logprobs(logits, torch.tensor([2]), 5)
    assert top_ids.tolist() == [[2, 0, 1, -1, -1]]
    assert top_logprobs[0, 2] == -float("inf")


def test_bad_tokens_are_refused_before_the_kernel_reads():
    with pytest.raises(ValueError, match=r"tokens must be 2 ids in \[0, 5\)"):
        native.logprobs(torch.zeros(2, 5), torch.tensor([0, 5]), 1)
    with pytest.raises(ValueError, match="tokens must be 2 ids"):
        native.logprobs(torch.zeros(2, 5), torch.tensor([0]), 1)
