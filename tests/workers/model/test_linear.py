"""The oneDNN-packed and native panel linear paths against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams
from workers.model import load_checkpoint
from workers.model.layers.linear import NativeLinear, PackedLinear, onednn_available

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


def test_packed_linear_equals_f_linear():
    linear = torch.nn.Linear(48, 80)
    packed = PackedLinear(linear)
    for rows in (1, 3, 8, 33):
        x = torch.randn(2, rows, 48)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_equals_f_linear_for_every_row_tiling(bias):
    # Rows are covered by tiles of 8, then one tile of the 1 … 7 left, in blocks of 64; inputs are walked in chunks
    # of 64 and outputs in panels of 48: these shapes hit every tail (and an empty input). Each row's result is bit
    # for bit the same whatever tile computed it (a verification's l rows equal l one-row decode steps).
    for in_features, out_features in [(37, 5), (200, 100), (512, 144)]:
        linear = torch.nn.Linear(in_features, out_features, bias=bias)
        native_linear = NativeLinear(linear)
        for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 15, 64, 65, 131):
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(native_linear(x), linear(x), atol=1e-4, rtol=1e-4)
            if rows:
                alone = torch.cat([native_linear(x[i : i + 1]) for i in range(rows)])
                assert torch.equal(native_linear(x), alone), f"{rows} rows"
    x = torch.randn(2, 3, 37)  # leading dims are kept
    torch.testing.assert_close(NativeLinear(linear := torch.nn.Linear(37, 5))(x), linear(x), atol=1e-5, rtol=1e-5)


def test_backends_agree_on_a_whole_model(checkpoint_dir):
    path = str(checkpoint_dir("nemotron_moe"))
    assert any(isinstance(m, NativeLinear) for m in load_checkpoint(path).model.modules())  # auto: native here
    runners = {b: ModelRunner.from_pretrained(path, linear_backend=b) for b in ("torch", "onednn", "native")}
    sequences = [[5, 9, 30, 31, 4, 77, 12, 100, 3], [8, 8, 8]]
    scores = {b: [torch.tensor(s.token_logprobs) for s in r.score(sequences)] for b, r in runners.items()}
    for backend in ("onednn", "native"):
        for a, b in zip(scores["torch"], scores[backend]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {b: [x.token_ids for x in r.generate(sequences, params)] for b, r in runners.items()}
    assert outputs["torch"] == outputs["onednn"] == outputs["native"]


def test_unknown_backend_is_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="linear_backend='mkl' is invalid: must be one of auto, torch, onednn, native"):
        load_checkpoint(str(checkpoint_dir("bamba")), linear_backend="mkl")
    with pytest.raises(ValueError, match="linear_backend='native' needs a CPU and float32 weights"):
        load_checkpoint(str(checkpoint_dir("bamba")), dtype="float16", linear_backend="native")
