"""JSON-schema-constrained generation against unconstrained generation, plain and with n-gram and draft-model
speculation, same prompts, same run (`jobs/benchmark.py --task structured`)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from workers import ModelRunner, SamplingParams, SpeculativeConfig, StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]
DEMO_DRAFT = ROOT / "examples" / "models" / "demo-draft"
# A list of records no row can finish within the benchmark's tokens: every row generates exactly --new-tokens
# tokens constrained or not, so the two runs do the same work but for the grammar.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
    },
    "minItems": 100,
}
PROMPTS = ["records = ", "# the rows as JSON\ndata = ", "def load():\n    return ", "CONFIG = "]


def _runners(args: argparse.Namespace, path: str, runner: ModelRunner) -> list[tuple[str, ModelRunner]]:
    """(label, runner): plain (the given one), n-gram and draft-model speculation."""
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch_sizes))
    common.update(decode_plan=not args.no_decode_plan, enable_prefix_caching=False)
    k, policy = (
        args.num_speculative_tokens,
        "adaptive" if args.speculative_policy == "curve" else args.speculative_policy,
    )
    draft = args.draft_model or (str(DEMO_DRAFT) if DEMO_DRAFT.exists() else path)
    specs = [
        ("ngram", SpeculativeConfig("ngram", k, policy=policy)),
        ("draft", SpeculativeConfig("draft", k, draft_model=draft, policy=policy)),
    ]
    return [("plain", runner)] + [
        (label, ModelRunner.from_pretrained(path, speculative=spec, **common)) for label, spec in specs
    ]


def _take_turns(
    target: ModelRunner, prompts: list[list[int]], params: dict[str, SamplingParams], repeats: int
) -> tuple[dict[str, int], dict[str, float]]:
    """Each run once to warm up, then `repeats` rounds taking turns (a slow stretch of the machine hits them
    alike): tokens generated per run and median seconds."""
    counts, times = {}, {name: [] for name in params}
    for round_index in range(repeats + 1):
        for name, p in params.items():
            start = time.perf_counter()
            results = target.generate(prompts, p)
            elapsed = time.perf_counter() - start
            assert all(r.finish_reason == "length" for r in results), "a constrained row finished early"
            counts[name] = sum(len(r.token_ids) for r in results)
            if round_index:
                times[name].append(elapsed)
    return counts, {name: statistics.median(t) for name, t in times.items()}


def bench_structured(args: argparse.Namespace, path: str, runner: ModelRunner) -> list[dict[str, Any]]:
    """Per batch size and way of decoding: tokens/s unconstrained and under a JSON schema (greedy, --new-tokens per
    row, the two taking turns in the same process), and their ratio (the target: ≥ 0.85). `generate` returns host
    token ids, so the times include the device's work."""
    if runner.tokenizer is None:
        raise SystemExit("--task structured needs a model with a tokenizer, e.g. --model examples/models/demo-target")
    constraint = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.new_tokens, structured_outputs=constraint)
    rows = []
    for label, target in _runners(args, path, runner):
        for batch in args.batch_sizes:
            prompts = [target.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
            counts, seconds = _take_turns(target, prompts, {"free": free, "json": constrained}, args.repeats)
            free_rate, json_rate = counts["free"] / seconds["free"], counts["json"] / seconds["json"]
            rows.append(
                {
                    "decoding": label,
                    "batch": batch,
                    "unconstrained_tokens_per_s": free_rate,
                    "json_schema_tokens_per_s": json_rate,
                    "ratio": json_rate / free_rate,
                }
            )
    return rows
