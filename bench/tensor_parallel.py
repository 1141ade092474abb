"""`--task tp`: what splitting a model over tensor-parallel ranks costs per decode step — collective calls, bytes
and seconds beside the step's wall time, at each `--tensor-parallel-sizes` (CPU: gloo between processes on this
machine), with the unsplit model's module path and its decode plan measured in the same run as the baseline.

Per decode step = (a run of `--new-tokens` tokens − a run of 1 token) / (new tokens − 1): prefill and start-up cancel
out. The counts are rank 0's (every rank runs the same collectives); its collective seconds include waiting for the
slower rank. On paper for GPUs, the same calls on NVLink: t = Σ α + ring bytes / β, with ring bytes per rank
2(T−1)/T × payload for an all-reduce (its payload halved: bf16 hidden states on GPU, float32 here) and (T−1)/T ×
the gathered logits for the all-gather; β and α from `--link-gbs` and `--link-latency-us`.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from bench.generation import random_prompts
from workers import ModelRunner, SamplingParams


def _counters(runner: ModelRunner) -> dict[str, list[float]]:
    """Rank 0's collective counters by kind: [calls, bytes, seconds] (copied)."""
    return {kind: list(entry) for kind, entry in runner.model.tp.group.stats.by_kind.items()}


def _run(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict[str, list[float]]]:
    """(wall seconds, collective counters spent) of one greedy generate call."""
    before = _counters(runner)
    start = time.perf_counter()
    runner.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    after = _counters(runner)
    kinds = set(before) | set(after)
    zero = [0, 0, 0.0]
    return seconds, {k: [a - b for a, b in zip(after.get(k, zero), before.get(k, zero))] for k in kinds}


def _per_step(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, Any]:
    """The decode step's wall time and collectives: the median over `repeats` of (long run − one-token run)."""
    _run(runner, prompts, 2)  # warm-up: workspaces and plans built
    samples = []
    for _ in range(repeats):
        short_s, short = _run(runner, prompts, 1)
        long_s, long = _run(runner, prompts, new_tokens)
        steps = new_tokens - 1
        per_kind = {k: [(long[k][i] - short.get(k, [0, 0, 0.0])[i]) / steps for i in range(3)] for k in long}
        samples.append(((long_s - short_s) / steps, per_kind))
    samples.sort(key=lambda sample: sample[0])
    return {"step_s": samples[len(samples) // 2][0], "per_kind": samples[len(samples) // 2][1]}


def _on_paper(per_kind: dict[str, list[float]], size: int, link_gbs: float, latency_us: float) -> float:
    """Seconds per step the same collectives would take on a GPU link (see the module docstring)."""
    if size == 1:
        return 0.0
    reduce_calls, reduce_bytes, _ = per_kind.get("all_reduce", [0, 0, 0.0])
    gather_calls, gather_bytes, _ = per_kind.get("all_gather", [0, 0, 0.0])
    ring = 2 * (size - 1) / size * (reduce_bytes / 2) + (size - 1) * gather_bytes  # gather: each rank's share in
    return (reduce_calls + gather_calls) * latency_us * 1e-6 + ring / (link_gbs * 1e9)


def bench_tensor_parallel(args: argparse.Namespace, path: str) -> list[dict[str, Any]]:
    """One row per (batch size, layout): the unsplit module path and decode plan, then each tensor-parallel size."""
    threads = args.threads or torch.get_num_threads()
    layouts = [("T=1, decode plan", 1, True), ("T=1, module path", 1, False)]
    layouts += [(f"T={size}", size, False) for size in args.tensor_parallel_sizes if size > 1]
    rows = []
    for name, size, plan in layouts:
        runner = ModelRunner.from_pretrained(
            path,
            max_num_seqs=max(args.batch_sizes),
            tensor_parallel_size=size,
            decode_plan=plan,
            num_threads=max(1, threads // size),
            enable_prefix_caching=False,
        )
        try:
            for batch in args.batch_sizes:
                prompts = random_prompts(batch, args.prompt_len, runner.config.vocab_size)
                rows.append(_row(name, size, batch, _per_step(runner, prompts, args.new_tokens, args.repeats), args))
        finally:
            runner.close()
    return rows


def _row(name: str, size: int, batch: int, measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    per_kind, step_s = measured["per_kind"], measured["step_s"]
    collective_s = sum(entry[2] for entry in per_kind.values())
    paper_s = _on_paper(per_kind, size, args.link_gbs, args.link_latency_us)
    return {
        "layout": name + (" (oversubscribed: more ranks than cores)" if size > (os.cpu_count() or 1) else ""),
        "batch": batch,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": batch / step_s,
        "collective_calls": sum(entry[0] for entry in per_kind.values()),
        "all_reduce_kb": per_kind.get("all_reduce", [0, 0, 0])[1] / 1e3,
        "all_gather_kb": per_kind.get("all_gather", [0, 0, 0])[1] / 1e3,
        "collective_ms": 1e3 * collective_s,
        "collective_share": collective_s / step_s if step_s > 0 else 0.0,
        "gpu_link_collective_us_on_paper": 1e6 * paper_s,
    }
