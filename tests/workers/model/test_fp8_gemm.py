"""The FP8 block reference in PyTorch, and `fp8_gemm_cases.py` run in a fresh process with TRITON_INTERPRET=1
(Triton picks its interpreter at import; see test_triton_kernels.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.model.interpreted import assert_cases_pass_in_the_interpreter, needs_triton
from workers.model.kernels.fp8 import dequantize_fp8_blocks

CASES = Path(__file__).with_name("fp8_gemm_cases.py")


def test_reference_scales_each_block_and_cuts_the_edges():
    weight = torch.full((130, 129), 0x38, dtype=torch.uint8)  # e4m3 0x38 = 1.0
    scales = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    out = dequantize_fp8_blocks(weight, scales)
    assert out.shape == (130, 129) and out.dtype == torch.float32
    assert (out[:128, :128] == 2).all() and (out[:128, 128] == 3).all()
    assert (out[128:, :128] == 5).all() and (out[128:, 128] == 7).all()


def test_reference_refuses_a_scale_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"scale_inv has shape \(1, 1\), expected \(2, 1\)"):
        dequantize_fp8_blocks(torch.zeros(130, 5, dtype=torch.uint8), torch.ones(1, 1))


@needs_triton
def test_fp8_kernel_matches_the_reference_in_the_interpreter():
    assert_cases_pass_in_the_interpreter(CASES)
