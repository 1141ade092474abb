"""`--task logprobs`: what `SamplingParams.logprobs` costs — output tokens/s with the top 5 logprobs per generated
token against none, on the same runner, prompts and batch sizes, in alternating rounds (the target: ≤ 5 %)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.generation import random_prompts
from workers import ModelRunner, SamplingParams

NUM_LOGPROBS = 5


def _seconds(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams) -> float:
    """Wall time of one generate call (synchronized on CUDA)."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = runner.generate(prompts, params)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    assert all((r.logprobs is None) == (params.logprobs is None) for r in results)
    return time.perf_counter() - start


def bench_logprobs(args: argparse.Namespace, runner: ModelRunner) -> list[dict[str, Any]]:
    """Per batch size: greedy output tokens/s without logprobs and with `--logprobs 5` (medians over --repeats
    rounds, each running both, after one warm-up of each), and the share of throughput the logprobs cost."""
    rows = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, runner.config.vocab_size)
        plain = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        asked = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=NUM_LOGPROBS)
        _seconds(runner, prompts, plain), _seconds(runner, prompts, asked)
        without, with_logprobs = [], []
        for _ in range(args.repeats):
            without.append(_seconds(runner, prompts, plain))
            with_logprobs.append(_seconds(runner, prompts, asked))
        tokens = batch * args.new_tokens
        rate, rate_logprobs = tokens / statistics.median(without), tokens / statistics.median(with_logprobs)
        rows.append(
            {
                "batch": batch,
                "output_tokens_per_s": rate,
                f"logprobs_{NUM_LOGPROBS}_tokens_per_s": rate_logprobs,
                "cost": 1 - rate_logprobs / rate,
            }
        )
    return rows
