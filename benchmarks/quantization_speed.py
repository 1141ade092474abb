"""float32 against int8 weights on the same preset, same process, alternating rounds (a shared machine's drifts
hit both alike): output tokens/s = batch × new tokens / (prefill + decode), as jobs/benchmark.py counts them.

python benchmarks/quantization_speed.py --preset bench --batch-sizes 1 8 32 --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from workers import ModelRunner, SamplingParams
from workers.benchmark import PRESETS, build_preset, random_prompts


def main() -> int:
    """Load the preset twice (float32, int8), then time each batch size in alternating rounds; print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}"))
    runners = {name: ModelRunner.from_pretrained(path, max_num_seqs=max(args.batch_sizes), quantization=q)
               for name, q in (("float32", None), ("int8", "int8"))}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"preset {args.preset}, {torch.get_num_threads()} threads, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, medians of {args.rounds} alternating rounds")  # fmt: skip
    print("batch  float32 tok/s  int8 tok/s  int8/float32  same greedy tokens")
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, runners["float32"].config.vocab_size)
        outputs = {name: [r.token_ids for r in runner.generate(prompts, params)] for name, runner in runners.items()}
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.generate(prompts, params)
                times[name].append(time.perf_counter() - start)
        rate = {name: batch * args.new_tokens / statistics.median(t) for name, t in times.items()}
        same = sum(a == b for x, y in zip(outputs["float32"], outputs["int8"]) for a, b in zip(x, y))
        print(f"{batch:5d}  {rate['float32']:13.1f}  {rate['int8']:10.1f}  {rate['int8'] / rate['float32']:12.2f}  "
              f"{same / sum(map(len, outputs['float32'])):.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
