"""bfloat16 weights for the native linear kernel (`csrc/linear_bf16.c`): packing, the call, and the one path a process
uses.

Paths: "amx" (AMX-BF16 tiles, `tdpbf16ps`), "avx512" (AVX512-BF16, `vdpbf16ps`) — both round the activations to
bfloat16 once per call — and "portable" (the weights widened to float32 in registers, float32 activations). The
process picks one the first time it asks (`bf16_path`) and keeps it, so that every row's result is the same whatever
the number of rows of a call: a speculative verification's [b · (k + 1)] rows round exactly as the [b]-row decode
steps do. `HYBRIDGEN_BF16_PATH` (amx, avx512, portable) forces one; one this machine lacks is a ValueError.
"""

from __future__ import annotations

import os

import torch

from workers.model.kernels.native import load, pointer

BF16_PATHS = {"portable": 0, "avx512": 1, "amx": 2}  # csrc/linear_bf16.c's codes
# Preferred first, by measurement (benchmarks/bf16_linear_paths.py on this project's Sapphire Rapids, 2 threads,
# the bench shapes): AMX 1.6-6x the float32 panels from 8 rows on and level with the others at 1 row (all read half
# float32's bytes); the portable path level with float32 from 8 rows on; AVX512-BF16 (vdpbf16ps) 1.1-1.6x SLOWER
# than float32 from 8 rows on, so it runs only when forced. Unmeasured on CPUs with AVX512-BF16 but no AMX (Zen 4).
PREFERENCE = ("amx", "portable", "avx512")
PATH_ENV = "HYBRIDGEN_BF16_PATH"

_PROCESS_PATH: str | None = None


def path_available(name: str) -> bool:
    """Whether the kernel path `name` can run here (built in, and allowed by the CPU and, for AMX, the OS)."""
    if name not in BF16_PATHS:
        raise ValueError(f"bfloat16 kernel path {name!r} is invalid: must be one of {', '.join(BF16_PATHS)}")
    return bool(load().linear_bf16_path_available(BF16_PATHS[name]))


def bf16_path() -> str:
    """The path every bfloat16 linear of this process runs (chosen at the first call, then fixed)."""
    global _PROCESS_PATH
    if _PROCESS_PATH is None:
        forced = os.environ.get(PATH_ENV)
        if forced:
            if not path_available(forced):
                raise ValueError(f"{PATH_ENV}={forced!r}: that bfloat16 kernel path cannot run on this machine")
            _PROCESS_PATH = forced
        else:
            _PROCESS_PATH = next(name for name in PREFERENCE if path_available(name))
    return _PROCESS_PATH


def pack_panels_bf16(weight: torch.Tensor, width: int) -> torch.Tensor:
    """A [N, K] weight rounded to bfloat16 (nearest even) and packed as [ceil(N / width), Kp / 2, width, 2]: per
    panel of `width` outputs, pairs of consecutive k (Kp: K rounded up to the kernel's alignment, zeros past K and
    past N). Packed a few panels at a time: no bfloat16 or float copy of the whole weight."""
    align = int(load().linear_bf16_k_align())
    out_features, in_features = weight.shape
    padded_k = -(-in_features // align) * align
    num_panels = -(-out_features // width)
    panels = torch.zeros(num_panels, padded_k // 2, width, 2, dtype=torch.bfloat16)
    step = max(1, (2 << 20) // (4 * width * max(1, padded_k)))  # panels per pass: ~2 MiB of temporaries
    for first in range(0, num_panels, step):
        rows = weight[first * width : (first + step) * width]
        count = -(-rows.shape[0] // width)
        padded = torch.zeros(count * width, padded_k, dtype=torch.bfloat16)
        padded[: rows.shape[0], :in_features] = rows
        # [count, width, Kp / 2, 2] → [count, Kp / 2, width, 2]
        panels[first : first + count] = padded.view(count, width, padded_k // 2, 2).transpose(1, 2)
    return panels


def linear_bf16(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int, path: str | None = None
) -> torch.Tensor:
    """x [M, K] float32 · wᵀ (+ bias) → [M, out_features] float32, w packed by `pack_panels_bf16`; `path` None: the
    process's (`bf16_path`)."""
    lib = load()
    path = bf16_path() if path is None else path
    if not path_available(path):
        raise ValueError(f"bfloat16 kernel path {path!r} cannot run on this machine")
    rows, in_features = x.shape
    num_panels, half_k, width, _ = panels.shape
    align = int(lib.linear_bf16_k_align())
    padded_k = -(-in_features // align) * align
    if panels.dtype != torch.bfloat16 or 2 * half_k != padded_k or num_panels * width < out_features:
        raise ValueError(
            f"x {tuple(x.shape)} does not fit bfloat16 panels {tuple(panels.shape)} for {out_features} outputs"
        )
    out = torch.empty(rows, out_features)
    if rows:
        lib.linear_panels_bf16(
            pointer(x),
            panels.data_ptr(),
            pointer(bias),
            pointer(out),
            rows,
            out_features,
            in_features,
            BF16_PATHS[path],
            torch.get_num_threads(),
        )
    return out
