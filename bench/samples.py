"""n samples per prompt against the workaround, duplicated rows, in one run (`jobs/benchmark.py --task n`).

Both modes run the same sampled requests: sample j of prompt i with n, and copy j of prompt i with seed
`sample_seed(seed, j)` as duplicated rows, so their tokens must agree. The duplicated rows run with the prefix cache
off (the issue's baseline: every copy computes its prompt) and, for reference, on (copies restore the first's
checkpoints). Prompt tokens computed come from the scheduler's own count of prefill tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from bench.generation import random_prompts
from workers import ModelRunner, SamplingParams, sample_seed

SEED = 1234


def _twin(runner: ModelRunner, caching: bool, max_num_seqs: int) -> ModelRunner:
    """Another runner over the same loaded model: `max_num_seqs` slots, the prefix cache on or off."""
    config = runner.engine_config.replace(max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    return ModelRunner(runner.model, runner.tokenizer, sorted(runner.eos_token_ids), config, speculative=None)


def _run(
    runner: ModelRunner, caching: bool, prompts: list[list[int]], params: list[SamplingParams], slots: int
) -> tuple[float, list[list[int]], dict[str, Any]]:
    """(seconds, tokens in prompt-major sample order, scheduler stats) of one run on a fresh twin (warmed up on a
    5-token prompt first: plans built, nothing cached)."""
    twin = _twin(runner, caching, slots)
    twin.generate([prompts[0][:5]], dataclasses.replace(params[0], n=1))
    before = twin.scheduler_stats()
    started = time.perf_counter()
    results = twin.generate(prompts, params)
    seconds = time.perf_counter() - started
    after = twin.scheduler_stats()
    stats = {key: after[key] - before[key] for key in ("prefill_tokens", "prefix_cache_hit_tokens")}
    return seconds, [r.token_ids for r in results], stats


def bench_samples(
    runner: ModelRunner, num_prompts: int, prompt_len: int, n: int, new_tokens: int, repeats: int = 1
) -> list[dict[str, Any]]:
    """`num_prompts` prompts of `prompt_len` tokens, `n` samples each of `new_tokens` tokens (temperature 1): with
    `SamplingParams.n` against n duplicated rows (prefix cache off, and on). Rounds alternate the modes, so that a
    slow stretch of a shared machine hits them alike; the median wall time is reported."""
    prompts = random_prompts(num_prompts, prompt_len, runner.config.vocab_size, seed=11)
    base = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=SEED)
    duplicated = [p for p in prompts for _ in range(n)]
    copies = [dataclasses.replace(base, seed=sample_seed(SEED, j)) for _ in prompts for j in range(n)]
    modes = {  # name → (prefix caching, prompts, params)
        f"n={n}": (False, prompts, [dataclasses.replace(base, n=n)] * num_prompts),
        f"{n} duplicated rows, cache off": (False, duplicated, copies),
        f"{n} duplicated rows, cache on": (True, duplicated, copies),
    }
    walls: dict[str, list[float]] = {name: [] for name in modes}
    outputs, stats = {}, {}
    for _ in range(repeats):
        for name, (caching, mode_prompts, params) in modes.items():
            seconds, outputs[name], stats[name] = _run(runner, caching, mode_prompts, params, num_prompts * n)
            walls[name].append(seconds)
    reference = outputs[f"n={n}"]
    rows = []
    for name in modes:
        wall = sorted(walls[name])[len(walls[name]) // 2]
        generated = sum(map(len, outputs[name]))
        rows.append(
            {
                "mode": name,
                "prompts": num_prompts,
                "sequences": num_prompts * n,
                "prompt_tokens_computed": stats[name]["prefill_tokens"],
                "prefix_hit_tokens": stats[name]["prefix_cache_hit_tokens"],
                "generated_tokens": generated,
                "wall_s": wall,
                "tokens_per_s": generated / wall,
                "identical_to_n": outputs[name] == reference,
            }
        )
    baseline = rows[1]["wall_s"]
    for row in rows:
        row["speedup_vs_duplicated_off"] = baseline / row["wall_s"]
    return rows


def bench_samples_per_batch(args: argparse.Namespace, runner: ModelRunner) -> list[dict[str, Any]]:
    """`bench_samples` for each of `--batch-sizes` prompts, with `--n`, `--prompt-len`, `--new-tokens`, `--repeats`."""
    return [
        row
        for batch in args.batch_sizes
        for row in bench_samples(runner, batch, args.prompt_len, args.n, args.new_tokens, args.repeats)
    ]
