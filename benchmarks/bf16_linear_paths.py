"""The bfloat16 linear kernel's paths (AMX, AVX512-BF16, portable) against the float32 panel kernel on the bench
presets' linear shapes, at M = 1, 8, 32, 128 rows: µs per call, best of alternating rounds (the numbers behind
native_bf16.PREFERENCE).

python benchmarks/bf16_linear_paths.py --threads 2 --rounds 7
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from workers.model.kernels import native, native_bf16

# (in, out) of the bench / gdn-bench linears: Mamba2 in_proj, MLP gate+up, MLP down, Mamba2 out_proj, the LM head.
SHAPES = [(512, 2320), (512, 3072), (1536, 512), (1024, 512), (512, 32000)]


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    """Print µs per call for each shape and row count: float32 panels, then each bf16 path available here."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    width = int(native.load().linear_panel_width())
    paths = [name for name in ("avx512", "amx", "portable") if native_bf16.path_available(name)]
    print(f"{torch.get_num_threads()} threads, best of {args.rounds} alternating rounds, µs per call")
    print("   in    out  rows   float32  " + "  ".join(f"{name:>8}" for name in paths))
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features)
        f32, bf16 = native.pack_panels(weight), native_bf16.pack_panels_bf16(weight, width)
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            calls = max(3, int(2e8 // (rows * in_features * out_features)))
            kernels = {"float32": lambda: native.linear(x, f32, None, out_features)}
            for name in paths:
                kernels[name] = lambda name=name: native_bf16.linear_bf16(x, bf16, None, out_features, name)
            best = {name: float("inf") for name in kernels}
            for _ in range(args.rounds):
                for name, fn in kernels.items():
                    best[name] = min(best[name], _time(fn, calls))
            cells = "  ".join(f"{best[name]:8.1f}" for name in kernels)
            print(f"{in_features:5d}  {out_features:5d}  {rows:4d}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
