"""The FP8 block GEMM kernel against the PyTorch reference; run with TRITON_INTERPRET=1 by test_fp8_gemm.py."""

from __future__ import annotations

import pytest
import torch

from workers.model.kernels.fp8 import dequantize_fp8_blocks
from workers.model.kernels.triton_kernels import interpreter_on

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="run by test_fp8_gemm.py with TRITON_INTERPRET=1")


def random_fp8(num_out: int, num_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 bytes (no NaN) and positive block scales."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (num_out, num_in), dtype=torch.uint8, generator=generator)
    weight[(weight & 0x7F) == 0x7F] = 0x3C  # NaN bytes → 1.5
    scales = torch.rand(-(-num_out // 128), -(-num_in // 128), generator=generator) * 0.01 + 1e-3
    return weight, scales


def test_every_byte_decodes_as_torch_float8_e4m3fn():
    from workers.model.kernels.triton_kernels.fp8_gemm import fp8_block_linear

    # With K = 1 and x = 1, out[0, n] = decode(weight[n, 0]) exactly (scale 1, one term).
    weight = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    out = fp8_block_linear(torch.ones(1, 1), weight, torch.ones(2, 1))[0]
    expected = weight.view(torch.float8_e4m3fn).float()[:, 0]
    nan = expected.isnan()
    assert nan.sum() == 2 and out[nan].isnan().all()
    assert torch.equal(out[~nan], expected[~nan])


@pytest.mark.parametrize(
    "num_rows, num_out, num_in, bias",
    [(1, 64, 128, False), (3, 70, 200, True), (17, 129, 257, False), (5, 300, 100, True), (33, 1, 384, False)],
)
def test_kernel_matches_dequantized_matmul(num_rows, num_out, num_in, bias):
    from workers.model.kernels.triton_kernels.fp8_gemm import fp8_block_linear

    weight, scales = random_fp8(num_out, num_in, seed=num_rows + num_out)
    x = torch.randn(num_rows, num_in, generator=torch.Generator().manual_seed(num_in))
    b = torch.randn(num_out) if bias else None
    expected = x.double() @ dequantize_fp8_blocks(weight, scales).double().T
    expected = expected if b is None else expected + b.double()
    out = fp8_block_linear(x, weight, scales, b)
    assert out.shape == (num_rows, num_out) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_in_bfloat16_matches_within_bfloat16_rounding():
    from workers.model.kernels.triton_kernels.fp8_gemm import fp8_block_linear

    weight, scales = random_fp8(96, 160, seed=7)
    x = torch.randn(4, 160, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = (x.float() @ dequantize_fp8_blocks(weight, scales).T).bfloat16()
    out = fp8_block_linear(x, weight, scales)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-2)  # within ~2 bfloat16 ulps of the rounded sum


def test_bad_scale_shape_is_refused():
    from workers.model.kernels.triton_kernels.fp8_gemm import fp8_block_linear

    weight, _ = random_fp8(130, 128, seed=0)
    with pytest.raises(ValueError, match=r"scale_inv must be float32 \(2, 1\)"):
        fp8_block_linear(torch.randn(2, 128), weight, torch.ones(1, 1))
