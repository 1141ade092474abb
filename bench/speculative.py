"""Speculative decoding against plain decoding on the same prompts, same run (`jobs/benchmark.py --speculative`)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.generation import copy_heavy_prompts, timed
from workers import ModelRunner, SamplingParams, SpeculativeConfig


def _spec_variants(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(label, policy, k) of every speculative configuration to measure: one, or the whole curve."""
    k = args.num_speculative_tokens
    if args.speculative_policy != "curve":
        return [
            (
                f"{args.speculative_policy} k≤{k}" if args.speculative_policy == "adaptive" else f"fixed k={k}",
                args.speculative_policy,
                k,
            )
        ]
    return [(f"fixed k={j}", "fixed", j) for j in range(1, k + 1)] + [(f"adaptive k≤{k}", "adaptive", k)]


def _spec_prompts(args: argparse.Namespace, runner: ModelRunner, batch: int) -> list[list[int]]:
    """At least `--min-prompts` prompts, and a whole batch: from `--prompts` (of `--prompt-kind`), else generated."""
    count = max(batch, args.min_prompts)
    if not args.prompts:
        return copy_heavy_prompts(count, args.prompt_len, runner.config.vocab_size)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    texts = [row["prompt"] for row in rows if args.prompt_kind in (None, row.get("kind"))]
    if len(texts) < count:
        raise SystemExit(
            f"--prompts {args.prompts} has {len(texts)} prompts of kind {args.prompt_kind!r}, {count} needed"
        )
    return [runner.tokenizer.encode(text) for text in texts[:count]]


def bench_speculative(args: argparse.Namespace, path: str, runner: ModelRunner) -> list[dict[str, Any]]:
    """Spec decode vs plain on the same prompts, same run: at batch b the prompts run b at a time; plain and every
    speculative configuration take turns, each repeat, so that a slow stretch of the machine hits them alike.
    Greedy outputs must agree. Tokens per second count the tokens generated (eos may stop a request early);
    `decode_speedup` leaves out the prompts' prefill and first token (timed alone, the same for both), which
    speculation cannot speed up — with ~280-token prompts and 64 new tokens it is half of a batch-1 run on CPU."""
    spec_runners = _spec_runners(args, path, runner)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=not args.prompts)
    rows = []
    for batch in args.batch_sizes:
        prompts = _spec_prompts(args, runner, batch)
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

        def run(target: ModelRunner) -> list[list[int]]:
            return [result.token_ids for group in groups for result in target.generate(group, params)]

        engines = {"plain": runner, **spec_runners}
        first_token = SamplingParams(temperature=0, max_tokens=1)
        prefill = timed(lambda: [runner.generate(group, first_token) for group in groups], args.repeats, runner.device)
        expected = run(runner)
        same = {label: run(r) == expected for label, r in spec_runners.items()}  # also the warm-up
        before = {label: r.spec_stats() for label, r in spec_runners.items()}
        times = _alternating_times(engines, run, args.repeats)
        tokens = sum(len(t) for t in expected)
        plain = statistics.median(times["plain"])
        for label, spec_runner in spec_runners.items():
            fast = statistics.median(times[label])
            row = _spec_row(args, label, batch, len(prompts), before[label], spec_runner.spec_stats())
            row.update(
                identical_to_plain=same[label], plain_tokens_per_s=tokens / plain, spec_tokens_per_s=tokens / fast
            )
            row.update(
                speedup=plain / fast, decode_speedup=(plain - prefill.seconds) / max(fast - prefill.seconds, 1e-9)
            )
            rows.append(row)
    return rows


def _spec_runners(args: argparse.Namespace, path: str, runner: ModelRunner) -> dict[str, ModelRunner]:
    """A runner per speculative configuration, on the plain runner's device."""
    draft = (args.draft_model or path) if args.speculative == "draft" else None
    return {
        label: ModelRunner.from_pretrained(
            path,
            device=str(runner.device),
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes),
            speculative=SpeculativeConfig(args.speculative, k, draft_model=draft, policy=policy),
            decode_kernel=args.decode_kernel,
            decode_plan=not args.no_decode_plan,
            quantization=args.quantization,
        )
        for label, policy, k in _spec_variants(args)
    }


def _alternating_times(
    engines: dict[str, ModelRunner], run: Callable[[ModelRunner], Any], repeats: int
) -> dict[str, list[float]]:
    """Seconds of `run(engine)` per engine, the engines taking turns each repeat."""
    times: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(repeats):
        for label, target in engines.items():
            start = time.perf_counter()
            run(target)
            times[label].append(time.perf_counter() - start)
    return times


def _spec_row(
    args: argparse.Namespace, label: str, batch: int, num_prompts: int, before: dict, after: dict
) -> dict[str, Any]:
    """A speculative configuration's acceptance over the timed runs (its stats before and after them)."""
    drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_draft_tokens"] - before["num_accepted_draft_tokens"]
    steps = after["num_drafts"] - before["num_drafts"]
    chosen = {k: n - before["num_steps_by_k"].get(k, 0) for k, n in after["num_steps_by_k"].items()}
    return {
        "engine": f"hybridgen+{args.speculative}",
        "policy": label,
        "batch": batch,
        "prompts": num_prompts,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": 1 + accepted / steps if steps else 1.0,
        "steps_by_k": " ".join(f"{k}:{n}" for k, n in sorted(chosen.items()) if n),
    }
