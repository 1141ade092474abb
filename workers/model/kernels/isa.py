"""Which instruction-set variant of the native kernels a CPU runs: the variants, their compiler flags, the choice.

Each variant is the same C sources compiled with another `-march`; `csrc/simd.h` sizes vectors and register tiles
from what the flags enable. A process runs one variant (`native.selected_isa()`, fixed at first use), and tests load
the others beside it (`native.load(isa)`). `auto` runs the native kernels on every variant: against PyTorch on the
same CPU (benchmarks/isa_compare.py; docs/benchmarks.md, "Every CPU") the avx512 and avx2 builds measured faster at
batch 1, 8 and 32 and on prompts on every preset.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

import torch

ISA_ENV = "HYBRIDGEN_CPU_ISA"
# The instruction-set variants the library is built for, and the compiler flags of each (csrc/simd.h sizes the
# vectors and register tiles from what they enable). "avx512" builds for this CPU (AMX, AVX512-BF16 and VNNI where it
# has them); "avx2" and "portable" build for the x86-64-v3 (AVX2 + FMA) and x86-64-v2 (SSE4.2) baselines, so an
# AVX-512 machine also runs, and tests, what an AVX2-only one runs.
ISA_FLAGS: dict[str, list[str]] = {
    "avx512": ["-march=native", "-mprefer-vector-width=512"],  # full-width AVX-512 (gcc defaults to 256)
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "neon": ["-mcpu=native"],  # aarch64
    "portable": ["-march=x86-64-v2", "-mtune=native"] if platform.machine() in ("x86_64", "AMD64") else [],
}


def cpu_isas() -> tuple[str, ...]:
    """The kernel variants this CPU can run, fastest first (from PyTorch's own CPU detection on x86)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ("neon",)  # NEON is aarch64's baseline: no narrower build to offer
    if machine not in ("x86_64", "amd64"):
        return ("portable",)
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ("avx512", "avx2", "portable"), "AVX2": ("avx2", "portable")}.get(capability, ("portable",))


def choose_isa(environ: Mapping[str, str] = os.environ) -> str:
    """The variant a process with this environment runs: `$HYBRIDGEN_CPU_ISA` when set (one of `cpu_isas()`), else
    the fastest. Raises ValueError naming the allowed values for a variant this CPU cannot run."""
    isas = cpu_isas()
    chosen = environ.get(ISA_ENV, "").strip().lower()
    if not chosen:
        return isas[0]
    if chosen not in isas:
        raise ValueError(f"{ISA_ENV}={chosen!r} cannot run on this CPU: choose one of {', '.join(isas)}")
    return chosen
