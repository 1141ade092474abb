"""The int8 × int8 kernel (csrc/linear_w8a8.c) against PyTorch: its packing, exact integer sums, every path and
row tiling equal bit for bit, odd shapes and groups, and the PyTorch reference module."""

from __future__ import annotations

import pytest
import torch

from workers.model.kernels import native, w8a8
from workers.model.layers.linear_w8a8 import W8A8Linear, W8A8Reference

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")

# (K, N, G): N not a multiple of 48, K not a multiple of 4, of 32 or of G; one group (None) or several.
SHAPES = [(37, 5, None), (37, 50, 32), (130, 49, 128), (300, 100, 64), (600, 144, 32), (257, 97, 4), (64, 48, None)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 64, 65, 70]
needs_vnni = pytest.mark.skipif(
    not native.available() or "vnni" not in w8a8.available_paths(), reason="no AVX512-VNNI on this CPU (or build)"
)
needs_avx2 = pytest.mark.skipif(
    not native.available() or "avx2" not in w8a8.available_paths(), reason="the kernels are built without AVX2 here"
)
FAST_PATHS = [pytest.param("vnni", marks=needs_vnni), pytest.param("avx2", marks=needs_avx2)]


def test_packing_layout_scale_and_correction():
    weight = torch.randn(50, 37)
    weight[3] = 0  # an all-zero channel: scale 1, q 0
    packed = w8a8.pack(weight, 8)
    q, scale = w8a8.quantize_weight(weight, 8)  # [50, 5, 8], [50, 5]
    assert packed.panels.shape == (2, 10, 48, 4) and packed.scale.shape == packed.correction.shape == (2, 5, 48)
    assert q.abs().max() == 127 and not q[3].any() and (scale[3] == 1).all()
    padded = torch.zeros(96, 40, dtype=torch.int8)
    padded[:50] = q.view(50, 40)
    assert torch.equal(packed.panels, padded.view(2, 48, 10, 4).transpose(1, 2))
    assert torch.equal(packed.scale.transpose(1, 2).reshape(96, 5)[:50], scale)
    assert torch.equal(packed.correction.transpose(1, 2).reshape(96, 5)[:50], 128 * q.sum(2, dtype=torch.int32))
    error = (q.float() * scale[..., None]).view(50, 40)[:, :37] - weight
    assert (error.abs() <= scale.repeat_interleave(8, 1)[:, :37] / 2 + 1e-7).all()  # rounded to nearest


def test_invalid_group_size_names_the_rule():
    with pytest.raises(ValueError, match="multiple of 4"):
        w8a8.pack(torch.randn(4, 8), 6)


@pytest.mark.parametrize("path", ["portable", *FAST_PATHS])
def test_integer_sums_are_exact(path):
    # Integer inputs whose every group holds ±127 quantize to themselves with scale 1: y is x · wᵀ exactly.
    torch.manual_seed(0)
    x, weight = torch.randint(-127, 128, (9, 64)).float(), torch.randint(-127, 128, (70, 64)).float()
    x[:, ::32], weight[:, ::32] = 127, -127
    out = w8a8.linear(x, w8a8.pack(weight, 32), None, path)
    assert torch.equal(out.double(), x.double() @ weight.double().t())


@pytest.mark.parametrize(("in_features", "out_features", "group_size"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_portable_kernel_equals_reference(in_features, out_features, group_size, bias):
    torch.manual_seed(in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    kernel, reference = W8A8Linear(linear, group_size), W8A8Reference(linear, group_size)
    for rows in ROWS:
        x = torch.randn(rows, in_features)
        out = w8a8.linear(x, kernel.packed, kernel.bias, "portable")
        torch.testing.assert_close(out, reference(x), atol=2e-5, rtol=2e-5)
        close_to_float = torch.nn.functional.linear(x, linear.weight, linear.bias)
        torch.testing.assert_close(out, close_to_float, atol=0.05 * close_to_float.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize(("in_features", "out_features", "group_size"), SHAPES)
def test_fast_paths_equal_portable_bit_for_bit(path, in_features, out_features, group_size):
    torch.manual_seed(out_features)
    kernel = W8A8Linear(torch.nn.Linear(in_features, out_features), group_size)
    for rows in ROWS:
        x = torch.randn(rows, in_features)
        portable = w8a8.linear(x, kernel.packed, kernel.bias, "portable")
        assert torch.equal(w8a8.linear(x, kernel.packed, kernel.bias, path), portable), f"{rows} rows"


@pytest.mark.parametrize(("in_features", "out_features", "group_size"), SHAPES[:4])
def test_a_rows_result_does_not_depend_on_its_batch(in_features, out_features, group_size):
    kernel = W8A8Linear(torch.nn.Linear(in_features, out_features), group_size)
    x = torch.randn(70, in_features)
    x[5] = 0  # an all-zero row: scale 0, output the bias
    together = kernel(x)
    assert torch.equal(together[5], kernel.bias)
    for rows in (1, 3, 4, 9):
        split = torch.cat([kernel(x[i : i + rows]) for i in range(0, 70, rows)])
        assert torch.equal(split, together), f"{rows} rows at a time"


def test_empty_batch_and_wrong_width():
    kernel = W8A8Linear(torch.nn.Linear(16, 8), None)
    assert kernel(torch.randn(0, 16)).shape == (0, 8)
    assert kernel(torch.randn(2, 3, 16)).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="does not fit"):
        w8a8.linear(torch.randn(2, 15), kernel.packed, None)
    with pytest.raises(ValueError, match="path='amx' is invalid"):
        w8a8.linear(torch.randn(2, 16), kernel.packed, None, "amx")


@pytest.mark.parametrize("bias", [False, True])
def test_lm_head_top_k_recomputed_in_float32(bias):
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 500, bias=bias)
    head, reference = W8A8Linear(linear, 32, top_k=8), W8A8Reference(linear, 32, top_k=8)
    x = torch.randn(70, 96)
    out, expected = head(x), linear(x).detach()
    torch.testing.assert_close(out, reference(x), atol=2e-5, rtol=2e-5)
    int8_only = w8a8.linear(x, head.packed, head.bias)
    top = torch.sort(int8_only, dim=1, descending=True, stable=True)[1][:, :8]  # [M, 8]: what was recomputed
    torch.testing.assert_close(out.gather(1, top), expected.gather(1, top), atol=1e-5, rtol=1e-5)
    rest = torch.ones_like(out, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(out[rest], int8_only[rest])
    assert torch.equal(out.argmax(1), expected.argmax(1))  # float32's best token is always in the int8 top 8 here
    assert torch.equal(torch.cat([head(x[i : i + 3]) for i in range(0, 70, 3)]), out)  # whatever the batch


def test_rescoring_ties_keep_the_lower_index():
    x, weight = torch.ones(1, 4), torch.arange(24, dtype=torch.float32).view(6, 4)
    logits = torch.zeros(1, 6)
    logits[0, 4] = 1  # the largest, then the tied zeros in index order
    w8a8.rescore_top(x, weight, None, logits, 3)
    assert logits.tolist() == [[6.0, 22.0, 0.0, 0.0, 70.0, 0.0]]
