"""float32 against int8 weights on the same preset, same process, alternating rounds (a shared machine's drifts
hit both alike): output tokens/s = batch × new tokens / (prefill + decode), as jobs/benchmark.py counts them.
Prints a table, and writes the figures as JSON with --json.

python benchmarks/quantization_speed.py --preset bench --batch-sizes 1 8 32 --rounds 5 --threads 2
python benchmarks/quantization_speed.py --preset gdn-bench --quantizations int8 int8_weight_only --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from workers import ModelRunner, SamplingParams
from workers.benchmark import PRESETS, build_preset, random_prompts
from workers.model.layers.linear import QUANTIZATIONS


def _rates(runners: dict, prompts: list[list[int]], params: SamplingParams, rounds: int) -> dict[str, float]:
    """Output tokens/s of each runner: medians over `rounds` alternating rounds."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
    return {name: len(prompts) * params.max_tokens / statistics.median(t) for name, t in times.items()}


def main() -> int:
    """Load the preset in float32 and each quantization, then time each batch size in alternating rounds."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--quantizations", choices=QUANTIZATIONS, nargs="+", default=["int8"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}"))
    runners = {name: ModelRunner.from_pretrained(path, max_num_seqs=max(args.batch_sizes), quantization=q)
               for name, q in [("float32", None)] + [(q, q) for q in args.quantizations]}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"preset {args.preset}, {torch.get_num_threads()} threads, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, medians of {args.rounds} alternating rounds")  # fmt: skip
    print("batch  " + "  ".join(f"{name + ' tok/s':>22s}  {'×float32':>8s}  {'same tokens':>11s}" for name in runners))
    rows = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, runners["float32"].config.vocab_size)
        outputs = {name: [r.token_ids for r in runner.generate(prompts, params)] for name, runner in runners.items()}
        rate = _rates(runners, prompts, params, args.rounds)
        total = sum(map(len, outputs["float32"]))
        same = {name: sum(a == b for x, y in zip(outputs["float32"], out) for a, b in zip(x, y)) / total
                for name, out in outputs.items()}  # fmt: skip
        rows.append({"batch": batch, "tokens_per_s": rate, "same_greedy_tokens_as_float32": same})
        print(f"{batch:5d}  " + "  ".join(f"{rate[name]:22.1f}  {rate[name] / rate['float32']:8.2f}  {same[name]:11.0%}"
                                          for name in runners))  # fmt: skip
    if args.json:
        result = {"preset": args.preset, "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
                  "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
