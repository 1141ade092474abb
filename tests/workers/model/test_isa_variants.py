"""Every instruction-set variant of the native kernels this machine can run, against PyTorch and the arithmetic.

An AVX-512 machine runs the avx512, avx2 and portable builds; an AVX2 one the last two. Each is loaded side by side
in this process (`native.load(isa)`), so every test here runs every variant the CPU can execute. The slow test runs
the kernel test files once more under each other variant (`HYBRIDGEN_CPU_ISA`), and an aarch64 build is compiled
with a cross compiler and checked under qemu-user where those are installed (`native_check.c`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.model.kernels import native

if not native.available():
    pytest.skip("no native kernels here (no C compiler)", allow_module_level=True)

VARIANTS = native.cpu_isas()
HERE = Path(__file__).parent
UNIT_ROUNDOFF = 2.0**-24


def _linear(isa: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lib = native.load(isa)
    panels = native.pack_panels(weight, int(lib.linear_panel_width()))
    out = torch.empty(x.shape[0], weight.shape[0])
    lib.linear_panels(
        x.data_ptr(),
        panels.data_ptr(),
        native.pointer(bias),
        out.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        2,
    )
    return out


def _float32_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """|error| of any float32 evaluation of x · wᵀ + bias: (K + 2) · u · (|x| · |w|ᵀ + |bias|), Higham's γ_K."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return (weight.shape[1] + 2) * UNIT_ROUNDOFF * magnitude


def test_the_variants_are_the_cpus_and_a_forced_one_is_checked():
    assert VARIANTS[-1] in ("portable", "neon") and len(set(VARIANTS)) == len(VARIANTS)
    assert native.choose_isa({}) == VARIANTS[0]  # the fastest by default
    assert native.choose_isa({native.ISA_ENV: f" {VARIANTS[-1].upper()} "}) == VARIANTS[-1]
    with pytest.raises(
        ValueError, match=f"HYBRIDGEN_CPU_ISA='avx1024' cannot run on this CPU: choose one of {', '.join(VARIANTS)}"
    ):
        native.choose_isa({native.ISA_ENV: "avx1024"})
    with pytest.raises(ValueError, match="no kernel variant 'sse9'"):
        native.load("sse9")
    assert native.selected_isa() == native.choose_isa()  # fixed at the first call


def test_the_runner_logs_which_kernels_run_and_why(checkpoint_dir, caplog):
    from workers import ModelRunner

    with caplog.at_level(logging.INFO, logger="workers.runner"):
        ModelRunner.from_pretrained(str(checkpoint_dir("granite_dense")))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("decode steps on cpu"))
    assert f"native CPU kernels: {native.selected_isa()} kernels (" in line and "this CPU runs" in line


@pytest.mark.parametrize("isa", VARIANTS)
def test_each_build_reports_its_instruction_set_and_panel_width(isa):
    lib = native.load(isa)
    assert lib.kernel_isa().decode() == isa
    assert int(lib.linear_panel_width()) == {"avx512": 48, "avx2": 24}.get(isa, 12)  # 3 vectors of its width


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 64, 67])
def test_float32_linear_within_the_arithmetics_bound_and_batch_invariant(isa, rows):
    g = torch.Generator().manual_seed(rows)
    for out_features, in_features in [(1, 1), (13, 37), (50, 130), (100, 64), (97, 300)]:  # K, N off every tile
        x, weight = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
        bias = torch.randn(out_features, generator=g)
        out = _linear(isa, x, weight, bias)
        error = (out.double() - F.linear(x.double(), weight.double(), bias.double())).abs()
        assert (error <= _float32_bound(x, weight, bias)).all()  # what F.linear's own float32 result also meets
        for r in {0, rows // 2, rows - 1}:  # a row's result whatever the rows beside it, bit for bit
            assert torch.equal(_linear(isa, x[r : r + 1].clone(), weight, bias)[0], out[r])


@pytest.mark.skipif(not {"avx512", "avx2"} <= set(VARIANTS), reason="needs a CPU that runs both AVX-512 and AVX2")
def test_avx512_and_avx2_linears_agree_bit_for_bit():
    """Both fuse each k's multiply-add and sum k in order: the register tile's shape changes no result."""
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (
        torch.randn(19, 333, generator=g),
        torch.randn(101, 333, generator=g),
        torch.randn(101, generator=g),
    )
    assert torch.equal(_linear("avx512", x, weight, bias), _linear("avx2", x, weight, bias))


@pytest.mark.parametrize("isa", VARIANTS)
def test_int8_linear_matches_its_dequantized_reference(isa):
    lib = native.load(isa)
    g = torch.Generator().manual_seed(1)
    for rows, out_features, in_features in [(1, 50, 37), (5, 13, 130), (67, 100, 64)]:
        x, weight = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
        panels, scale = native.pack_panels_int8(weight, int(lib.linear_panel_width()))
        out = torch.empty(rows, out_features)
        lib.linear_panels_int8(
            x.data_ptr(), panels.data_ptr(), scale.data_ptr(), None, out.data_ptr(), rows, out_features, in_features, 2
        )
        q = torch.round(weight / scale[:, None]).clamp(-127, 127)
        reference = F.linear(x.double(), q.double()) * scale.double()
        bound = (in_features + 4) * UNIT_ROUNDOFF * (x.double().abs() @ (q.double().abs() * scale.double()[:, None]).T)
        assert ((out.double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("isa", VARIANTS)
def test_elementwise_kernels_and_argmax_match_torch(isa):
    lib = native.load(isa)
    g = torch.Generator().manual_seed(2)
    for rows, d in [(1, 5), (3, 37), (9, 130)]:  # widths off every vector width
        fused = torch.randn(rows, 2 * d, generator=g) * 20
        out = torch.empty(rows, d)
        lib.silu_mul(fused.data_ptr(), out.data_ptr(), rows, d, 2)
        gate, up = fused.chunk(2, dim=-1)
        torch.testing.assert_close(out, F.silu(gate) * up)
        x, weight = torch.randn(rows, d, generator=g), torch.randn(d, generator=g)
        normed = torch.empty(rows, d)
        lib.rms_norm(x.data_ptr(), weight.data_ptr(), 1e-5, normed.data_ptr(), rows, d, 2)
        torch.testing.assert_close(normed, F.rms_norm(x, (d,), weight, 1e-5))
    for n in [1, 3, 8, 15, 16, 17, 33, 1000]:
        logits = torch.randn(4, n, generator=g)
        logits[1, n // 2] = logits[1, n - 1] = 100.0  # a tie: the first index wins
        logits[2, n - 1] = float("nan")  # NaN counts as the largest
        logits[3] = -float("inf")
        found = torch.empty(4, dtype=torch.long)
        lib.argmax_rows(logits.data_ptr(), found.data_ptr(), 4, n, 2)
        assert found.tolist() == logits.argmax(-1).tolist()


KERNEL_TEST_FILES = [
    "test_native.py",
    "test_linear.py",
    "test_int8.py",
    "test_linear_bf16.py",
    "test_w8a8.py",
    "test_gdn_native.py",
    "test_gdn_prefill_native.py",
    "test_kimi_native.py",
    "test_decode_plan.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("isa", VARIANTS[1:])
def test_the_kernel_tests_pass_under_every_other_variant(isa):
    """The kernel and decode-plan tests again, in a process whose kernels are this variant's (the fastest one
    already ran them in this session)."""
    environment = {**os.environ, native.ISA_ENV: isa}
    files = [str(HERE / name) for name in KERNEL_TEST_FILES]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        env=environment,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 cross compiler (apt: gcc-aarch64-linux-gnu)"
)
def test_an_aarch64_build_compiles_and_its_kernels_are_right_under_qemu(tmp_path):
    """The NEON variant: compiled with the cross compiler, run under qemu-user when it is installed."""
    program = tmp_path / "native_check"
    command = [
        "aarch64-linux-gnu-gcc",
        "-O3",
        "-march=armv8-a",
        "-fopenmp",
        "-static",
        "-I",
        str(native.SOURCES[0].parent),
        *map(str, native.SOURCES),
        str(HERE / "native_check.c"),
        "-o",
        str(program),
        "-lm",
    ]
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    if shutil.which("qemu-aarch64") is None:
        pytest.skip("the aarch64 build compiled; no qemu-aarch64 to run it (apt: qemu-user)")
    done = subprocess.run(["qemu-aarch64", str(program)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "kernels built for neon" in done.stdout, done.stdout[-4000:]
    assert "checks ok, 0 failed" in done.stdout
