"""int8 (or bfloat16) weights against float32 on the demo prompts: greedy tokens equal to float32's over 64 new
tokens, |Δ log-prob| of float32's greedy continuations scored by both, and greedy speculative (draft model) ==
greedy plain under the variant. Prints a table, and writes the figures as JSON with --json.

python benchmarks/quantization_quality.py --model examples/models/demo-target --draft examples/models/demo-draft
python benchmarks/quantization_quality.py --model examples/models/demo-gdn --variant bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model.layers.linear import QUANTIZATIONS

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}} | {q: {"quantization": q} for q in QUANTIZATIONS}


def main() -> int:
    """Print the agreement figures as a table (and write them as JSON with --json)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "examples/models/demo-target"))
    p.add_argument(
        "--variant", choices=sorted(set(VARIANTS) - {"float32"}), default="int8", help="the weights to compare"
    )
    p.add_argument("--draft", default=None, help="also check greedy speculative == plain under the variant with it")
    p.add_argument("--prompts", default=str(ROOT / "examples/prompts.jsonl"))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args()
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    runners = {
        name: ModelRunner.from_pretrained(args.model, max_num_seqs=32, **VARIANTS[name])
        for name in ("float32", args.variant)
    }
    prompts = [runners["float32"].tokenizer.encode(row["prompt"]) for row in rows[: args.max_prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    outputs = {q: [r.token_ids for r in runner.generate(prompts, params)] for q, runner in runners.items()}
    same = sum(a == b for x, y in zip(outputs["float32"], outputs[args.variant]) for a, b in zip(x, y))
    prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(*outputs.values()))
    total = sum(map(len, outputs["float32"]))
    sequences = [prompt + out for prompt, out in zip(prompts, outputs["float32"])]
    scores = {q: [torch.tensor(s.token_logprobs) for s in r.score(sequences)] for q, r in runners.items()}
    deltas = torch.cat([(a - b)[len(prompt) - 1 :].abs() for a, b, prompt in zip(*scores.values(), prompts)])
    result = {"model": args.model, "variant": args.variant, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "greedy_tokens_equal_to_float32": same / total,
              "greedy_tokens_before_first_difference": prefix / total,
              "mean_abs_delta_logprob": deltas.mean().item(), "max_abs_delta_logprob": deltas.max().item()}  # fmt: skip
    if args.draft:
        speculative = SpeculativeConfig("draft", 4, draft_model=args.draft)
        spec = ModelRunner.from_pretrained(
            args.model, max_num_seqs=32, speculative=speculative, **VARIANTS[args.variant]
        )
        spec_outputs = [r.token_ids for r in spec.generate(prompts, params)]
        result[f"{args.variant}_speculative_equals_plain"] = spec_outputs == outputs[args.variant]
        result[f"{args.variant}_acceptance_rate"] = spec.spec_stats()["acceptance_rate"]
    for key, value in result.items():
        print(f"{key:40s} {value:.4f}" if isinstance(value, float) else f"{key:40s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
