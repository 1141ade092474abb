"""Where a planned decode step's time goes: the decode plan's records replayed one by one, in order (the caches
see what a whole step gives them), timed and summed per op; a table, and JSON with --json.

python benchmarks/decode_step_profile.py --preset gdn-bench --variant bfloat16 --batch 32
python benchmarks/decode_step_profile.py --preset bench --variant float32 --batch 1 --json out.json

Each record costs one extra ctypes call here (a few µs), so the total is a little above a real step's; the
generation runs plain decode steps only (no speculation) so every step is the same list of records.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.generation import PRESETS, build_preset, random_prompts
from workers import ModelRunner, SamplingParams
from workers.model.steps.decode_plan import DecodePlan
from workers.model.steps.plan_records import Op

sys.path.insert(0, str(Path(__file__).parent))
from quantization_speed import VARIANTS, load_variant  # noqa: E402

LINEAR_OPS = (Op.LINEAR, Op.LINEAR_INT8, Op.LINEAR_BF16, Op.LINEAR_W8A8)


def label(record: torch.Tensor, last_linear: bool) -> str:
    """The row's name in the table: the op, the LM head apart from the block linears."""
    op = Op(int(record[0]))
    return "LM head" if op in LINEAR_OPS and last_linear else op.name


def profile(runner: ModelRunner, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """ms per step per op over a generation of `batch` rows, with records replayed one at a time."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    steps = 0
    original = DecodePlan.replay

    def timed_replay(plan: DecodePlan, records: torch.Tensor) -> None:
        nonlocal steps
        steps += 1
        linears = [i for i in range(records.shape[0]) if int(records[i, 0]) in LINEAR_OPS]
        for i in range(records.shape[0]):
            start = time.perf_counter()
            original(plan, records[i : i + 1])
            name = label(records[i], bool(linears) and i == linears[-1])
            totals[name] += time.perf_counter() - start
            counts[name] += 1

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = random_prompts(batch, args.prompt_len, runner.config.vocab_size)
    runner.generate(prompts, params)  # warm: plans recorded, buffers touched
    DecodePlan.replay = timed_replay  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        runner.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        DecodePlan.replay = original  # type: ignore[method-assign]
    if not steps:
        raise SystemExit("no planned decode steps ran (native kernels off, or a GPU runner)")
    per_step = {name: 1e3 * t / steps for name, t in totals.items()}
    return {
        "batch": batch,
        "steps": steps,
        "generate_s": wall,
        "ms_per_step": per_step,
        "records_per_step": {name: c // steps for name, c in counts.items()},
    }


def main() -> int:
    """Load the preset as one variant, profile its planned decode steps at each batch size; print tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gdn-bench")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}"))
    runner = load_variant(path, args.variant, max(args.batch))
    results = []
    for batch in args.batch:
        result = profile(runner, batch, args)
        results.append(result)
        total = sum(result["ms_per_step"].values())
        print(
            f"\n{args.preset} {args.variant}, batch {batch}, {torch.get_num_threads()} threads: "
            f"{total:.2f} ms per decode step over {result['steps']} steps"
        )
        print(f"{'op':<20} {'records':>8} {'ms/step':>9} {'share':>7}")
        for name, ms in sorted(result["ms_per_step"].items(), key=lambda kv: -kv[1]):
            print(f"{name:<20} {result['records_per_step'][name]:>8} {ms:>9.3f} {ms / total:>7.1%}")
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k != "json"} | {"threads": torch.get_num_threads()}
        Path(args.json).write_text(json.dumps({"setup": setup, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
