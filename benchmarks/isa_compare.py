"""`auto` against the all-PyTorch path on each instruction set this CPU runs, same machine, same run: prints a table,
writes JSON.

Each variant runs in its own process with PyTorch held to the same instruction set (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`) and hybridgen's kernels forced to it (`HYBRIDGEN_CPU_ISA`), so an
AVX-512 machine measures what an AVX2-only or SSE-only machine would run. In each process, the runner with
`auto` everything and the runner with `linear_backend="torch", decode_kernel="torch", decode_plan=False` alternate
rounds on the same random-weight preset: decode (32-token prompts, 64 new tokens, output tok/s at each batch size)
and prefill (prompt tok/s of 1 × 1024 and 8 × 512 tokens with one new token). Best of `--rounds` per cell.

python benchmarks/isa_compare.py --presets bench gdn-bench lfm2-bench falcon-h1-bench --json isa.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# PyTorch's own switches for each variant: its ATen kernels, oneDNN and MKL held to the same instructions.
TORCH_LIMITS = {
    "avx512": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "neon": {},
}
PATHS = {"auto": {}, "torch": {"linear_backend": "torch", "decode_kernel": "torch", "decode_plan": False}}
PREFILLS = ((1, 1024), (8, 512))


def measure(preset: str, batch_sizes: list[int], rounds: int, threads: int) -> dict[str, Any]:
    """In this process: best output tok/s per path and batch size, and prompt tok/s per prefill shape."""
    import torch

    from bench.generation import build_preset, random_prompts
    from workers import ModelRunner, SamplingParams
    from workers.model.kernels import native

    torch.set_num_threads(threads)
    checkpoint = build_preset(preset, Path(tempfile.gettempdir()) / f"hybridgen-{preset}")
    runners = {name: ModelRunner.from_pretrained(str(checkpoint), **options) for name, options in PATHS.items()}
    vocab = runners["auto"].model.config.vocab_size
    cells: list[tuple[str, list[list[int]], int]] = [
        (f"decode b{b}", random_prompts(b, 32, vocab), 64) for b in batch_sizes
    ]
    cells += [(f"prefill {b}x{length}", random_prompts(b, length, vocab), 1) for b, length in PREFILLS]
    best: dict[str, dict[str, float]] = {cell: {name: 0.0 for name in PATHS} for cell, _, _ in cells}
    for cell, prompts, new_tokens in cells:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        tokens = len(prompts) * (new_tokens if new_tokens > 1 else len(prompts[0]))
        for _ in range(rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.generate(prompts, params)
                best[cell][name] = max(best[cell][name], tokens / (time.perf_counter() - start))
    return {"isa": native.selected_isa(), "torch_capability": torch.backends.cpu.get_cpu_capability(), "cells": best}


def run_variant(isa: str, preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """`measure` in a fresh process held to `isa`."""
    environment = {**os.environ, **TORCH_LIMITS.get(isa, {}), "HYBRIDGEN_CPU_ISA": isa}
    command = [
        sys.executable,
        __file__,
        "--worker",
        preset,
        "--rounds",
        str(args.rounds),
        "--threads",
        str(args.threads),
        "--batch-sizes",
        *map(str, args.batch_sizes),
    ]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{isa} {preset} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    """Measure each variant on each preset; print the table; write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["bench", "gdn-bench", "lfm2-bench", "falcon-h1-bench"])
    p.add_argument("--isas", nargs="+", default=None, help="variants to measure (default: every one this CPU runs)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one preset in this process
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.batch_sizes, args.rounds, args.threads)))
        return 0
    from workers.model.kernels.isa import cpu_isas

    isas = args.isas or list(cpu_isas())
    rows = []
    print(f"{args.threads} threads, best of {args.rounds} alternating rounds; auto / all-PyTorch, tok/s")
    print("| preset | kernels | torch held to | cell | auto | all-PyTorch | ratio |\n|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for isa in isas:
            result = run_variant(isa, preset, args)
            for cell, rates in result["cells"].items():
                ratio = rates["auto"] / rates["torch"]
                rows.append(
                    {
                        "preset": preset,
                        "isa": result["isa"],
                        "torch": result["torch_capability"],
                        "cell": cell,
                        **rates,
                        "ratio": ratio,
                    }
                )
                print(
                    f"| {preset} | {result['isa']} | {result['torch_capability']} | {cell} | {rates['auto']:,.0f} | "
                    f"{rates['torch']:,.0f} | {ratio:.2f}× |",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
