"""Long-context benchmark: peak memory and speed of long prompts, hybridgen against transformers, in one run.

python jobs/long_context.py                                  # docs/long-contexts.md's table (bench preset, CPU; ~40 min)
python jobs/long_context.py --lengths 4096 16384 --cases 2x4096x8 --engines hybridgen
python jobs/long_context.py --baseline-src /path/to/older/checkout   # also run hybridgen from another source tree

Every measurement runs in a fresh subprocess, so its peak RSS (ru_maxrss) is its own. `--lengths`: one prompt of
each length, 1 new token — prefill tokens/s and peak memory (transformers: one `forward` with logits for the last
position only, under an address-space limit of `--transformers-memory-limit` so a run that does not fit fails
instead of swapping; every measurement runs under that limit). `--cases NxLxT`: N prompts of L tokens, T new tokens
each, through `ModelRunner.generate` with default options; `--baseline-src` runs the cases from another tree too.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this process (run through `--one`): wall seconds, tokens/s and peak RSS."""
    import torch

    from bench.generation import random_prompts

    torch.manual_seed(0)
    prompts = random_prompts(spec["n"], spec["length"], 32000)
    if spec["engine"] == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
        start = time.perf_counter()
        with torch.no_grad():
            model(torch.tensor(prompts), logits_to_keep=1)
        wall, new_tokens = time.perf_counter() - start, 0
    else:
        from workers import ModelRunner, SamplingParams

        options = {"max_num_batched_tokens": spec["budget"]} if spec.get("budget") else {}
        runner = ModelRunner.from_pretrained(
            spec["path"], max_num_seqs=64, max_model_len=spec["length"] + spec["new"], **options
        )
        params = SamplingParams(max_tokens=spec["new"], temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        results = runner.generate(prompts, params)
        wall = time.perf_counter() - start
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(errors[0])
        new_tokens = sum(len(r.token_ids) for r in results)
    prompt_tokens = spec["n"] * spec["length"]
    return {
        **spec,
        "wall_s": round(wall, 2),
        "prompt_tok_s": round(prompt_tokens / wall, 1),
        "new_tok_s": round(new_tokens / wall, 1) if new_tokens else None,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def run_one(spec: dict[str, Any], source: Path, timeout: int, memory_limit_gb: float) -> dict[str, Any]:
    """`measure(spec)` in a subprocess with `source` first on the path; failures become a `result` string."""
    env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{ROOT}"}
    command = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
    command += ["--memory-limit-gb", str(memory_limit_gb)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "result": f"timed out after {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**spec, "result": f"failed (address space limit {memory_limit_gb} GB): {tail[:160]}"}
    return {**json.loads(lines[-1]), "result": "ok"}


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per measurement."""
    header = (
        f"{'engine':<22} {'prompts':>7} {'tokens':>8} {'new':>4} {'wall s':>8} {'prompt tok/s':>12} "
        f"{'new tok/s':>9} {'peak RSS GB':>11}  result"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        label = r["label"] + (f" budget {r['budget']}" if r.get("budget") else "")
        print(
            f"{label:<22} {r['n']:>7} {r['length']:>8} {r['new']:>4} {r.get('wall_s', ''):>8} "
            f"{r.get('prompt_tok_s', ''):>12} {r.get('new_tok_s') or '':>9} {r.get('peak_rss_gb', ''):>11}  "
            f"{r['result']}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and the cases; print the table and write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--memory-limit-gb", type=float, help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384, 65536, 131072])
    p.add_argument("--cases", nargs="*", default=["2x32768x8", "32x8192x256"], help="NxLxT: N prompts of L tokens")
    p.add_argument("--engines", nargs="*", default=["hybridgen", "transformers"], choices=["hybridgen", "transformers"])
    p.add_argument(
        "--budgets",
        type=int,
        nargs="*",
        default=[],
        help="also prefill the first --lengths prompt with each of these max_num_batched_tokens",
    )
    p.add_argument("--baseline-src", type=Path, help="also run hybridgen's measurements from this source tree")
    p.add_argument("--memory-limit", type=float, default=18.0, help="GB of address space per measurement")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    p.add_argument("--out", type=Path, default=Path("long_context.json"))
    args = p.parse_args(argv)
    if args.one:
        if args.memory_limit_gb:
            limit = int(args.memory_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(measure(json.loads(args.one))))
        return 0
    from bench.generation import build_preset

    path = str(build_preset("bench", Path(tempfile.gettempdir()) / "hybridgen-bench"))
    runs = [(dict(engine=e, n=1, length=n, new=1), e, ROOT) for n in args.lengths for e in args.engines]
    for budget in args.budgets:
        runs.append((dict(engine="hybridgen", n=1, length=args.lengths[0], new=1, budget=budget), "hybridgen", ROOT))
    for case in args.cases:
        n, length, new = (int(x) for x in case.split("x"))
        runs.append((dict(engine="hybridgen", n=n, length=length, new=new), "hybridgen", ROOT))
        if args.baseline_src:
            runs.append((runs[-1][0], "hybridgen (baseline)", args.baseline_src))
    rows = []
    for spec, label, source in runs:
        row = {**run_one({**spec, "path": path}, source, args.timeout, args.memory_limit), "label": label}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print_table(rows)
    args.out.write_text(json.dumps({"model": path, "torch_threads": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
