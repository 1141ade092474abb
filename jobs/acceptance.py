"""Draft acceptance on the held-out demo prompts: MTP on demo-gdn next to demo-draft drafting for demo-target.

    python jobs/acceptance.py                      # k = 1, 2, 3 on all 200 prompts, 64 greedy tokens each
    python jobs/acceptance.py --num-prompts 40 --ks 1 2

Every run uses the fixed speculation policy, so each verification step asks for exactly k drafts (fewer only where
a request has fewer than k + 1 tokens left to generate). Acceptance at position j is the share of verification
steps whose j-th draft was accepted (so it falls with j: draft j counts only when drafts 1 … j-1 were accepted);
the mean accepted length is the tokens a step produces, 1 + accepted drafts. Greedy outputs are checked against
plain decoding of the same target. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from workers import ModelRunner, SamplingParams, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Acceptance-report flags."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--prompts", default=str(ROOT / "examples" / "prompts.jsonl"), help="JSONL with a `prompt` column")
    p.add_argument("--num-prompts", type=int, default=200, help="the first N prompts")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="drafts per step")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--target", default=str(MODELS / "demo-target"), help="target of the draft model")
    p.add_argument("--draft-model", default=str(MODELS / "demo-draft"), help="the draft model")
    p.add_argument("--mtp-model", default=str(MODELS / "demo-gdn"), help="a checkpoint with an MTP head")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests decoded together")
    p.add_argument("--json", default="acceptance.json", help="where to write the results")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, prompts: list[str]) -> list[dict[str, Any]]:
    """One row per (method, k): acceptance per position, mean accepted length, whether greedy output equals plain."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    setups = [("mtp", args.mtp_model, None), ("draft", args.target, args.draft_model)]
    rows = []
    for method, path, draft in setups:
        plain = ModelRunner.from_pretrained(path, dtype="float32", max_num_seqs=args.max_num_seqs)
        token_ids = [plain.tokenizer.encode(text) for text in prompts]
        expected = [r.token_ids for r in plain.generate(token_ids, params)]
        for k in args.ks:
            speculative = SpeculativeConfig(method, k, draft_model=draft, policy="fixed")
            runner = ModelRunner.from_pretrained(
                path, dtype="float32", max_num_seqs=args.max_num_seqs, speculative=speculative
            )
            start = time.perf_counter()
            results = runner.generate(token_ids, params)
            seconds = time.perf_counter() - start
            stats = runner.spec_stats()
            rows.append(
                {
                    "method": method,
                    "model": Path(path).name,
                    "draft": Path(draft).name if draft else "mtp head",
                    "k": k,
                    "acceptance_per_position": stats["acceptance_per_position"][:k],
                    "acceptance_rate": stats["acceptance_rate"],
                    "mean_accepted_length": stats["mean_accepted_length"],
                    "num_verification_steps": stats["num_drafts"],
                    "identical_to_plain": [r.token_ids for r in results] == expected,
                    "seconds": seconds,
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """Rows as an aligned text table, positions as columns."""
    width = max(row["k"] for row in rows)
    header = ["method", "target", "k", *(f"pos{j + 1}" for j in range(width)), "rate", "mean_len", "steps", "same"]
    cells = [
        [row["method"], row["model"], str(row["k"])]
        + [f"{row['acceptance_per_position'][j]:.3f}" if j < row["k"] else "" for j in range(width)]
        + [
            f"{row['acceptance_rate']:.3f}",
            f"{row['mean_accepted_length']:.3f}",
            str(row["num_verification_steps"]),
            str(row["identical_to_plain"]),
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def main(argv: list[str] | None = None) -> int:
    """Measure every (method, k), print the table and write the JSON."""
    args = parse_args(argv)
    lines = Path(args.prompts).read_text().splitlines()[: args.num_prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    rows = measure(args, prompts)
    print(f"draft acceptance, greedy, fixed k, {len(prompts)} prompts × ≤{args.max_tokens} tokens")
    print_table(rows)
    result = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
