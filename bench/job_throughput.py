"""Job-throughput measurements: shards streamed through one worker against one call per shard and one call over
every row (steps per generated token, slot occupancy, wall time). `jobs/benchmark.py --task shards` prints them."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from bench.generation import random_prompts
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.stream import SHARDS_PER_WORKER, ShardStream


def lognormal_lengths(num_rows: int, mean: float, low: int, high: int, seed: int = 0, sigma: float = 0.8) -> list[int]:
    """Output lengths drawn log-normally (about `mean` after clipping to [low, high]), as real completions vary."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(num_rows)]


def _one_call(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams], shard_rows: int):
    return [r.token_ids for r in runner.generate(prompts, params)]


def _call_per_shard(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams], shard_rows: int):
    out = []
    for start in range(0, len(prompts), shard_rows):
        out += [
            r.token_ids
            for r in runner.generate(prompts[start : start + shard_rows], params[start : start + shard_rows])
        ]
    return out


def _streamed(stream: ShardStream, prompts: list[list[int]], params: list[SamplingParams], shard_rows: int):
    """What a streaming worker does: SHARDS_PER_WORKER shards submitted, the next one as soon as one returns."""
    starts = list(range(0, len(prompts), shard_rows))
    in_flight: dict[Future, int] = {}
    results: dict[int, list[list[int]]] = {}
    for start in starts:
        if len(in_flight) >= SHARDS_PER_WORKER:
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                results[in_flight.pop(future)] = [r.token_ids for r in future.result()]
        rows = slice(start, start + shard_rows)
        future = stream.submit(start, zip(prompts[rows], params[rows]), len(prompts[rows]))
        in_flight[future] = start
    for future, start in in_flight.items():
        results[start] = [r.token_ids for r in future.result()]
    return [ids for start in starts for ids in results[start]]


def bench_shards(
    load: Callable[[], ModelRunner],
    num_rows: int,
    prompt_len: int,
    shard_rows: int,
    mean_new_tokens: float,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Each mode over the same rows (greedy, log-normal output lengths): steps, steps per generated token, mean slot
    occupancy and wall time, with ratios to one call. Raises if a mode's tokens differ from one call's. As in a
    worker, the runner is loaded (`load`) and run on a stream's engine thread, the one-call modes too."""
    stream = ShardStream()
    runner = stream.runner = stream.call(load).result()
    prompts = random_prompts(num_rows, prompt_len, runner.config.vocab_size, seed=1)
    lengths = lognormal_lengths(num_rows, mean_new_tokens, 8, 256)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    warm = runner.max_num_seqs
    stream.call(lambda: runner.generate(prompts[:warm], params[:warm])).result()  # warm-up: plans, policy
    modes: dict[str, Callable[[], list[list[int]]]] = {
        "one call": lambda: stream.call(lambda: _one_call(runner, prompts, params, shard_rows)).result(),
        "call per shard": lambda: stream.call(lambda: _call_per_shard(runner, prompts, params, shard_rows)).result(),
        "streamed": lambda: _streamed(stream, prompts, params, shard_rows),
    }
    walls: dict[str, list[float]] = {name: [] for name in modes}
    counts: dict[str, tuple[int, int, int]] = {}
    reference = None
    for _ in range(repeats):  # rounds alternate the modes: drifts of a shared machine hit them alike
        for name, mode in modes.items():
            before = runner.scheduler_stats()
            started = time.perf_counter()
            tokens = mode()
            walls[name].append(time.perf_counter() - started)
            after = runner.scheduler_stats()
            reference = reference or tokens
            if tokens != reference:
                raise AssertionError(f"{name}: tokens differ from one call's")
            counts[name] = (after["num_steps"] - before["num_steps"],
                            after["num_slot_steps"] - before["num_slot_steps"], sum(len(t) for t in tokens))  # fmt: skip
    rows = []
    for name in modes:
        steps, slot_steps, generated = counts[name]
        wall = sorted(walls[name])[len(walls[name]) // 2]
        rows.append(
            {
                "mode": name,
                "rows": num_rows,
                "shard_rows": shard_rows if name != "one call" else num_rows,
                "steps": steps,
                "steps_per_token": steps / generated,
                "occupancy": slot_steps / (steps * runner.max_num_seqs),
                "wall_s": wall,
                "tokens_per_s": generated / wall,
            }
        )
    for row in rows:
        row["steps_vs_one_call"] = row["steps"] / rows[0]["steps"]
        row["wall_vs_one_call"] = row["wall_s"] / rows[0]["wall_s"]
    return rows


def _twin(runner: ModelRunner, caching: bool) -> ModelRunner:
    """Another runner over the same loaded model, with the prefix cache on or off."""
    return ModelRunner(
        runner.model,
        runner.tokenizer,
        sorted(runner.eos_token_ids),
        runner.engine_config,
        enable_prefix_caching=caching,
        speculative=None,
    )


def _timed_generate(
    runner: ModelRunner, caching: bool, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[list[int]], int]:
    """(seconds, tokens, prefix-cache hit tokens) of one run on a fresh twin runner (the cache starts empty; a
    5-token warm-up builds its plans first)."""
    twin = _twin(runner, caching)
    twin.generate([prompts[0][:5]], params)
    started = time.perf_counter()
    results = twin.generate(prompts, params)
    seconds = time.perf_counter() - started
    return seconds, [r.token_ids for r in results], twin.scheduler_stats()["prefix_cache_hit_tokens"]


def bench_prefix(
    runner: ModelRunner,
    num_rows: int,
    prefix_len: int,
    suffix_len: int,
    new_tokens: int,
    num_distinct: int,
    distinct_len: int,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """A shared-prefix job (num_rows rows: one prefix_len-token prefix, own suffixes of about suffix_len tokens) with
    the prefix cache on and off, against the suffixes alone and the prefix once; and num_distinct rows of distinct
    prompts with the cache on and off (its cost where nothing is shared). Each cache-on run starts from an empty
    cache. Raises if cache on and off give different tokens."""
    vocab, rng = runner.config.vocab_size, random.Random(3)
    prefix = random_prompts(1, prefix_len, vocab, seed=5)[0]
    suffixes = [
        random_prompts(1, rng.randrange(suffix_len // 2, 3 * suffix_len // 2 + 1), vocab, seed=10 + i)[0]
        for i in range(num_rows)
    ]
    distinct = random_prompts(num_distinct, distinct_len, vocab, seed=7)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    workloads = {"shared prefix": [prefix + s for s in suffixes], "suffixes alone": suffixes, "prefix once": [prefix],
                 "distinct prompts": distinct}  # fmt: skip
    rows = []
    for name, prompts in workloads.items():
        variants = (False, True) if name in ("shared prefix", "distinct prompts") else (False,)
        outputs, walls, hits = {}, {caching: [] for caching in variants}, {}
        for _ in range(repeats):  # rounds alternate cache off and on: drifts of a shared machine hit both alike
            for caching in variants:
                seconds, outputs[caching], hits[caching] = _timed_generate(runner, caching, prompts, params)
                walls[caching].append(seconds)
        for caching in variants:
            rows.append(
                {
                    "workload": name,
                    "cache": "on" if caching else "off",
                    "rows": len(prompts),
                    "prompt_tokens": sum(map(len, prompts)),
                    "hit_tokens": hits[caching],
                    "wall_s": sorted(walls[caching])[len(walls[caching]) // 2],
                }
            )
        if len(outputs) == 2 and outputs[True] != outputs[False]:
            raise AssertionError(f"{name}: tokens differ with the prefix cache on and off")
    by = {(r["workload"], r["cache"]): r["wall_s"] for r in rows}
    for row in rows:
        if row["workload"] == "shared prefix":
            row["speedup_vs_off"] = by[("shared prefix", "off")] / row["wall_s"]
            row["vs_suffixes_alone"] = row["wall_s"] / by[("suffixes alone", "off")]
        if row["workload"] == "distinct prompts":
            row["speedup_vs_off"] = by[("distinct prompts", "off")] / row["wall_s"]
    return rows
