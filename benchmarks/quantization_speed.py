"""float32 against int8 and bfloat16 weights on the same preset, same process, alternating rounds (a shared
machine's drifts hit all alike): output tokens/s = batch × new tokens / (prefill + decode), as jobs/benchmark.py
counts them; a table, and JSON with --json.

python benchmarks/quantization_speed.py --preset bench --batch-sizes 1 8 32 --rounds 5 --threads 2
python benchmarks/quantization_speed.py --preset gdn-bench --variants float32 bfloat16 torch-bfloat16 --json out.json

Variants: float32; int8, int8_weight_only, w8a8 (that quantization); bfloat16 (dtype="bfloat16": bf16 linear weights on the native
kernels, the process's kernel path); bfloat16:amx, bfloat16:avx512, bfloat16:portable (that kernel path forced on
the model's linears, to compare paths in one process); torch-bfloat16 (dtype="bfloat16" with linear_backend="torch":
the all-PyTorch bfloat16 model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.generation import PRESETS, build_preset, random_prompts
from workers import ModelRunner, SamplingParams
from workers.model.layers.linear import NativeLinear

VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {},
    "int8": {"quantization": "int8"},
    "int8_weight_only": {"quantization": "int8_weight_only"},
    "w8a8": {"quantization": "w8a8"},
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16:amx": {"dtype": "bfloat16"},
    "bfloat16:avx512": {"dtype": "bfloat16"},
    "bfloat16:portable": {"dtype": "bfloat16"},
    "torch-bfloat16": {"dtype": "bfloat16", "linear_backend": "torch"},
}


def load_variant(path: str, name: str, max_num_seqs: int) -> ModelRunner:
    """The preset at `path` loaded as variant `name` (a forced bf16 kernel path set on every bf16 linear)."""
    runner = ModelRunner.from_pretrained(path, max_num_seqs=max_num_seqs, **VARIANTS[name])
    if ":" in name:
        for module in runner.model.modules():
            if isinstance(module, NativeLinear) and module.bf16_path is not None:
                module.bf16_path = name.split(":")[1]
    return runner


def measure(runners: dict[str, ModelRunner], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """tok/s per variant at `batch` (medians of alternating rounds) and each variant's greedy agreement with the
    first one's."""
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    first = next(iter(runners))
    prompts = random_prompts(batch, args.prompt_len, runners[first].config.vocab_size)
    outputs = {name: [r.token_ids for r in runner.generate(prompts, params)] for name, runner in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
    total = sum(map(len, outputs[first]))
    return {
        "batch": batch,
        "tok_s": {name: batch * args.new_tokens / statistics.median(t) for name, t in times.items()},
        "same_greedy_tokens": {
            name: sum(a == b for x, y in zip(outputs[first], out) for a, b in zip(x, y)) / total
            for name, out in outputs.items()
        },
    }


def main() -> int:
    """Load the preset once per variant, then time each batch size in alternating rounds; print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["float32", "int8"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}"))
    runners = {name: load_variant(path, name, max(args.batch_sizes)) for name in args.variants}
    print(
        f"preset {args.preset}, {torch.get_num_threads()} threads, {args.prompt_len}-token prompts, "
        f"{args.new_tokens} new tokens, medians of {args.rounds} alternating rounds; greedy tokens equal to "
        f"{args.variants[0]}'s in brackets"
    )
    print("batch  " + "  ".join(f"{name:>22}" for name in args.variants))
    results = []
    for batch in args.batch_sizes:
        result = measure(runners, batch, args)
        results.append(result)
        cells = [f"{result['tok_s'][n]:9.1f} tok/s ({result['same_greedy_tokens'][n]:4.0%})" for n in args.variants]
        print(f"{batch:5d}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k != "json"} | {"threads": torch.get_num_threads()}
        Path(args.json).write_text(json.dumps({"setup": setup, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
