"""The oneDNN-packed linear path against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams
from workers.model import load_checkpoint
from workers.model.linear import PackedLinear, onednn_available

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


def test_packed_linear_equals_f_linear():
    linear = torch.nn.Linear(48, 80)
    packed = PackedLinear(linear)
    for rows in (1, 3, 8, 33):
        x = torch.randn(2, rows, 48)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_backends_agree_on_a_whole_model(checkpoint_dir):
    path = str(checkpoint_dir("nemotron_moe"))
    assert any(isinstance(m, PackedLinear) for m in load_checkpoint(path).model.modules())  # auto picks oneDNN here
    runners = {b: ModelRunner.from_pretrained(path, linear_backend=b) for b in ("torch", "onednn")}
    sequences = [[5, 9, 30, 31, 4, 77, 12, 100, 3], [8, 8, 8]]
    scores = {b: [torch.tensor(s.token_logprobs) for s in r.score(sequences)] for b, r in runners.items()}
    for a, b in zip(scores["torch"], scores["onednn"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {b: [x.token_ids for x in r.generate(sequences, params)] for b, r in runners.items()}
    assert outputs["torch"] == outputs["onednn"]


def test_unknown_backend_is_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="linear_backend='mkl' is invalid: must be one of auto, torch, onednn"):
        load_checkpoint(str(checkpoint_dir("bamba")), linear_backend="mkl")
