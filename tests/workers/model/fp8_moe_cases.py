"""The FP8 grouped expert GEMM against the PyTorch reference (`Fp8Experts.reference_rows`); run with
TRITON_INTERPRET=1 by test_fp8_experts.py."""

from __future__ import annotations

import pytest
import torch

from workers.model.kernels.fp8 import split_scale_rows
from workers.model.kernels.triton_kernels import interpreter_on
from workers.model.layers.feed_forward import activate
from workers.model.layers.fp8_experts import Fp8Experts

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="run by test_fp8_experts.py with TRITON_INTERPRET=1")


def random_experts(num_experts: int, rows: int, width: int, inner: int, gated: bool, split: int) -> Fp8Experts:
    """Experts with random e4m3 bytes (no NaN) and positive block scales."""
    generator = torch.Generator().manual_seed(rows + width + inner)
    experts = Fp8Experts(num_experts, rows, width, inner, gated, split)
    for weight, scale in ((experts.up, experts.up_scale), (experts.down, experts.down_scale)):
        weight.copy_(torch.randint(0, 256, weight.shape, dtype=torch.uint8, generator=generator))
        weight[(weight & 0x7F) == 0x7F] = 0x3C  # NaN bytes → 1.5
        scale.copy_(torch.rand(scale.shape, generator=generator) * 1e-3 + 1e-4)  # outputs of order 1
    return experts


@pytest.mark.parametrize(
    "num_experts, rows, width, inner, gated, split",
    [
        (3, 320, 200, 160, True, 160),  # gate and up quantized apart, tails in every dimension
        (4, 256, 128, 128, True, 256),  # aligned, one fused tensor
        (3, 96, 136, 96, False, 96),  # relu² experts (Nemotron-H), rows under one block
    ],
)
def test_grouped_gemm_matches_the_reference(num_experts, rows, width, inner, gated, split):
    from workers.model.kernels.triton_kernels.fp8_moe import fp8_expert_rows

    experts = random_experts(num_experts, rows, width, inner, gated, split)
    assert experts.up_scale.shape[1] == split_scale_rows(rows, split)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(7, width, generator=generator)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:2] for _ in range(7)])  # 2 experts a token
    ids[1] = ids[0]  # two tokens on the same experts
    up, down = (experts.up, experts.up_scale, split), (experts.down, experts.down_scale)
    out = fp8_expert_rows(x, ids, up, down, gated, activate)
    expected = experts.reference_rows(x.double(), ids)
    assert out.shape == (14, width) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_scale_shape_is_refused():
    from workers.model.kernels.triton_kernels.fp8_moe import grouped_gemm

    experts = random_experts(2, 320, 128, 160, True, 160)
    rows, block_expert = torch.zeros(16, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"scale must be float32 \(2, 3, 1\)"):  # one tensor: 3 row blocks, not 4
        grouped_gemm(torch.randn(1, 128), rows, experts.up, experts.up_scale, block_expert, 320)


def test_another_ranks_experts_give_zeros_on_both_paths():
    """Expert parallel: an id of E (another rank's expert, as `MoE` passes it to kept FP8 experts) gives zeros in
    the Triton GEMM and in the reference; the other pairs are as without those slots."""
    from workers.model.kernels.triton_kernels.fp8_moe import fp8_expert_rows

    experts = random_experts(3, 96, 136, 96, False, 96)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, 136, generator=generator)
    ids = torch.randint(0, 4, (9, 2), generator=generator)  # 3: another rank's expert
    assert bool((ids == 3).any()) and bool((ids < 3).any())
    out = fp8_expert_rows(
        x, ids, (experts.up, experts.up_scale, 96), (experts.down, experts.down_scale), False, activate
    )
    expected = experts.reference_rows(x.double(), ids)
    foreign = (ids == 3).reshape(-1)
    assert not bool(out[foreign].any()) and not bool(expected[foreign].any())
    local = experts.reference_rows(x.double(), torch.where(ids == 3, 0, ids))[~foreign]
    torch.testing.assert_close(out.double()[~foreign], local, rtol=1e-5, atol=1e-5)
