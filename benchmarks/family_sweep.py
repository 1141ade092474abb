"""Every family's bench preset against transformers, in one sweep: generation at batch 1 and 8 (32-token prompts,
64 new tokens, output tok/s) and prefill of 2,048-token prompts at batch 4 (one new token, prompt tok/s). Each
preset runs `jobs/benchmark.py` in its own process (both engines in that process, same weights and prompts); prints
one summary table and writes JSON.

python benchmarks/family_sweep.py --json family_sweep.json                  # every family preset
python benchmarks/family_sweep.py --presets jamba-bench kimi-bench --skip-prefill
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESETS = [
    "falcon-h1-bench",
    "lfm2-bench",
    "lfm3-bench",
    "jamba-bench",
    "zamba2-bench",
    "kimi-bench",
    "olmo-bench",
]


def run_benchmark(arguments: list[str], threads: int, repeats: int) -> dict[str, Any]:
    """`jobs/benchmark.py` with `arguments` in a fresh process; its JSON."""
    with tempfile.TemporaryDirectory(prefix="hybridgen-sweep-") as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, str(ROOT / "jobs" / "benchmark.py"), *arguments]
        command += ["--threads", str(threads), "--repeats", str(repeats), "--json", str(out)]
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def sweep_preset(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """One preset's generation rows (batch 1 and 8) and prefill row (2,048 × 4), with its decode-plan state."""
    generate = run_benchmark(["--preset", preset, "--batch-sizes", "1", "8"], args.threads, args.repeats)
    row: dict[str, Any] = {"preset": preset, "decode_plan": generate["decode_plan"]}
    for result in generate["generate"]:
        batch = result["batch"]
        row[f"b{batch}_tok_s"] = round(result["output_tokens_per_s"], 1)
        row[f"b{batch}_transformers"] = round(result["transformers"]["output_tokens_per_s"], 1)
        row[f"b{batch}_ratio"] = round(result["ratio_to_transformers"], 2)
    if not args.skip_prefill:
        prefill = run_benchmark(
            ["--preset", preset, "--task", "prefill", "--prompt-len", "2048", "--batch-sizes", "4"],
            args.threads,
            args.prefill_repeats,
        )["prefill"][0]
        row["prefill_tok_s"] = round(prefill["prefill_tokens_per_s"], 1)
        row["prefill_transformers"] = round(prefill["transformers"]["prefill_tokens_per_s"], 1)
        row["prefill_ratio"] = round(prefill["ratio_to_transformers"], 2)
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=PRESETS, help="bench presets to run (default: every family's)")
    p.add_argument("--threads", type=int, default=2, help="torch and kernel threads")
    p.add_argument("--repeats", type=int, default=2, help="timed generation runs per cell (median)")
    p.add_argument("--prefill-repeats", type=int, default=1, help="timed prefill runs per cell (median)")
    p.add_argument("--skip-prefill", action="store_true", help="generation only")
    p.add_argument("--json", default="family_sweep.json", help="where to write the results")
    args = p.parse_args(argv)
    rows = []
    for preset in args.presets:
        rows.append(sweep_preset(preset, args))
        print(json.dumps(rows[-1]), flush=True)
    columns = [c for c in rows[0] if c != "decode_plan"] if rows else []
    print("\n" + " | ".join(columns))
    for row in rows:
        print(" | ".join(str(row.get(c, "")) for c in columns))
    Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
