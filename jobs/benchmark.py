"""Benchmark hybridgen against transformers on the same weights and prompts, in one run; prints a table, writes JSON.

python jobs/benchmark.py [--quantization int8] [--task score]  # bench model (hidden 512, 8 layers), CPU; or scoring
python jobs/benchmark.py --task shards --model examples/models/demo-target --batch-sizes 32   # streaming vs drains
python jobs/benchmark.py --task prefix --model examples/models/demo-target --num-rows 64 --new-tokens 16  # prefix cache
python jobs/benchmark.py --model DIR --speculative ngram  # spec decode on copy-heavy prompts vs plain
python jobs/benchmark.py --device cuda --preset granite-4.0-h-1b --batch-sizes 1 16 64 256   # graphs vs eager
python jobs/benchmark.py --task prefill --preset jamba-bench --prompt-len 2048 --batch-sizes 4  # long prompts, 1 token
python jobs/benchmark.py --task resume --num-shards 2000 100000  # driver bookkeeping: plan, resume, finalize
python jobs/benchmark.py --task logprobs  # tokens/s with --logprobs 5 against none, same run
python jobs/benchmark.py --task n --n 8 --prompt-len 1500 --batch-sizes 4  # n samples vs duplicated rows
python jobs/benchmark.py --task structured --model examples/models/demo-target --batch-sizes 32  # JSON schema vs free
python jobs/benchmark.py --task tp --preset qwen3-next-bench --tensor-parallel-sizes 2 4  # collectives per step
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.arguments import parse_args
from bench.driver_bookkeeping import bench_resume
from bench.generation import (
    H200_BANDWIDTH_GBS,
    batch1_roofline,
    build_preset,
    hf_generate_fn,
    hf_score_fn,
    peak_memory_mb,
    print_table,
    random_prompts,
    reset_peak_memory,
    timed,
)
from bench.job_throughput import bench_prefix, bench_shards
from bench.logprobs import bench_logprobs
from bench.samples import bench_samples_per_batch
from bench.speculative import bench_speculative
from bench.structured import bench_structured
from bench.tensor_parallel import bench_tensor_parallel
from workers import ModelRunner, SamplingParams
from workers.model.kernels import native
from workers.model.steps import cuda_graph
from workers.model.steps.decode_plan import unsupported_reason


def _hf_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def bench_generate(args: argparse.Namespace, path: str, runner: ModelRunner) -> list[dict[str, Any]]:
    """Prefill, decode and end-to-end tokens/s and peak memory per batch size, for hybridgen (and, when it runs
    CUDA graphs, the same weights eagerly) and transformers."""
    hf = None if args.no_transformers else _hf_model(path, runner.device, runner.dtype)
    eager = _eager_twin(runner) if runner.cuda_graphs else None
    rows = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, runner.config.vocab_size)
        row = _measure(runner, "hybridgen (graphs)" if eager else "hybridgen", prompts, args)
        if eager is not None:
            row["eager"] = _measure(eager, "hybridgen (eager)", prompts, args)
            row["graphs_speedup"] = row["output_tokens_per_s"] / row["eager"]["output_tokens_per_s"]
        if hf is not None:
            hf_first = timed(hf_generate_fn(hf, prompts, 1), args.repeats, runner.device)
            hf_full = timed(hf_generate_fn(hf, prompts, args.new_tokens), args.repeats, runner.device)
            row["transformers"] = _rates("transformers", batch, args, hf_first.seconds, hf_full.seconds)
            row["ratio_to_transformers"] = row["output_tokens_per_s"] / row["transformers"]["output_tokens_per_s"]
        rows.append(row)
    return rows


def _eager_twin(runner: ModelRunner) -> ModelRunner:
    """A runner over the same loaded weights that runs every step eagerly (no weights loaded twice)."""
    return ModelRunner(
        runner.model,
        runner.tokenizer,
        sorted(runner.eos_token_ids),
        runner.engine_config,
        cuda_graphs=False,
        speculative=None,
    )


def _measure(runner: ModelRunner, engine: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Rates of one engine on `prompts` (a 1-token run times prefill), and its peak memory meanwhile."""
    reset_peak_memory(runner.device)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    first = timed(
        lambda: runner.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        args.repeats,
        runner.device,
    )
    full = timed(lambda: runner.generate(prompts, params), args.repeats, runner.device)
    return {
        **_rates(engine, len(prompts), args, first.seconds, full.seconds),
        "peak_memory_mb": peak_memory_mb(runner.device),
    }


def _rates(engine: str, batch: int, args: argparse.Namespace, prefill_s: float, total_s: float) -> dict[str, Any]:
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "engine": engine,
        "batch": batch,
        "prefill_tokens_per_s": batch * args.prompt_len / prefill_s,
        "decode_tokens_per_s": batch * (args.new_tokens - 1) / decode_s,
        "output_tokens_per_s": batch * args.new_tokens / total_s,
        "seconds": total_s,
    }


def bench_score(args: argparse.Namespace, path: str, runner: ModelRunner) -> list[dict[str, Any]]:
    """Scored tokens/s per batch size for hybridgen's `score` and transformers' forward."""
    hf = None if args.no_transformers else _hf_model(path, runner.device, runner.dtype)
    rows = []
    for batch in args.batch_sizes:
        data = random_prompts(batch, args.prompt_len, runner.config.vocab_size, seed=1)
        tokens = batch * (args.prompt_len - 1)
        ours = timed(lambda: runner.score(data), args.repeats, runner.device)
        row: dict[str, Any] = {"engine": "hybridgen", "batch": batch, "scored_tokens_per_s": tokens / ours.seconds}
        if hf is not None:
            theirs = timed(hf_score_fn(hf, data), args.repeats, runner.device)
            row["transformers"] = {"scored_tokens_per_s": tokens / theirs.seconds}
            row["ratio_to_transformers"] = row["scored_tokens_per_s"] / row["transformers"]["scored_tokens_per_s"]
        rows.append(row)
    return rows


def bench_prefill(args: argparse.Namespace, path: str, runner: ModelRunner) -> list[dict[str, Any]]:
    """Prompt tokens/s per batch size of runs that generate one token (prefill-bound: long prompts, short outputs,
    as scoring and classification jobs are), for hybridgen and transformers' `generate`."""
    hf = None if args.no_transformers else _hf_model(path, runner.device, runner.dtype)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, runner.config.vocab_size)
        tokens = batch * args.prompt_len
        ours = timed(lambda: runner.generate(prompts, params), args.repeats, runner.device)
        row: dict[str, Any] = {"engine": "hybridgen", "batch": batch, "prefill_tokens_per_s": tokens / ours.seconds}
        if hf is not None:
            theirs = timed(hf_generate_fn(hf, prompts, 1), args.repeats, runner.device)
            row["transformers"] = {"prefill_tokens_per_s": tokens / theirs.seconds}
            row["ratio_to_transformers"] = row["prefill_tokens_per_s"] / row["transformers"]["prefill_tokens_per_s"]
        rows.append(row)
    return rows


def bench_bookkeeping(args: argparse.Namespace) -> int:
    """The driver's plan, resume and finalize bookkeeping for each --num-shards (no model): printed and saved."""
    with tempfile.TemporaryDirectory(prefix="hybridgen-resume-") as scratch:
        rows = [bench_resume(n, Path(scratch) / f"output-{n}") for n in args.num_shards]
    print_table("shard bookkeeping (milliseconds)", rows)
    Path(args.json).write_text(json.dumps({"resume": rows, "args": vars(args)}, indent=2))
    return 0


def bench_job_shards(args: argparse.Namespace) -> int:
    """--task shards: a job's rows streamed through one worker against one call per shard and one call."""
    path = args.model or build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}")
    shard_rows = args.shard_rows or 2 * max(args.batch_sizes)

    def load() -> ModelRunner:
        if args.threads:
            torch.set_num_threads(args.threads)
        return ModelRunner.from_pretrained(
            str(path),
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes),
            quantization=args.quantization,
        )

    rows = bench_shards(load, args.num_rows, args.prompt_len, shard_rows, args.new_tokens, args.repeats)
    print_table(
        f"job of {args.num_rows} rows, max_num_seqs {max(args.batch_sizes)}, log-normal output lengths "
        f"(mean {args.new_tokens}): streamed shards vs one call",
        rows,
    )
    Path(args.json).write_text(json.dumps({"shards": rows, "model": str(path), "args": vars(args)}, indent=2))
    return 0


def bench_tp(args: argparse.Namespace) -> int:
    """`--task tp`: the decode step split over ranks (`bench/tensor_parallel.py`); prints a table, writes JSON."""
    path = args.model or build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}")
    rows = bench_tensor_parallel(args, str(path))
    print_table(
        f"tensor parallel decode step ({args.preset if not args.model else path}, {args.prompt_len}-token prompts, "
        f"{args.new_tokens} tokens; on paper: {args.link_gbs:.0f} GB/s, {args.link_latency_us:.0f} µs per call)",
        rows,
    )
    Path(args.json).write_text(json.dumps({"tp": rows, "model": str(path), "args": vars(args)}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Build or load the model, run the requested measurements, print and save them."""
    args = parse_args(argv, __doc__.splitlines()[0])
    standalone = {"resume": bench_bookkeeping, "shards": bench_job_shards, "tp": bench_tp}  # they load their own
    if args.task in standalone:
        return standalone[args.task](args)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}")
    runner = _load_runner(args, str(path))
    result = _describe_run(args, str(path), runner)
    if args.task == "prefix":
        result["prefix"] = bench_prefix(
            runner,
            args.num_rows,
            args.prefix_len,
            args.suffix_len,
            args.new_tokens,
            args.num_distinct,
            args.prompt_len,
            args.repeats,
        )
        print_table(
            f"prefix caching: {args.num_rows} rows sharing {args.prefix_len} tokens (+ ~{args.suffix_len} "
            f"own), {args.num_distinct} distinct prompts of {args.prompt_len}; {args.new_tokens} new tokens",
            result["prefix"],
        )
    elif args.task == "n":
        result["n"] = bench_samples_per_batch(args, runner)
        print_table(f"n={args.n} samples vs duplicated rows; {args.prompt_len}-token prompts", result["n"])
    elif args.task == "prefill":
        result["prefill"] = bench_prefill(args, str(path), runner)
        print_table(f"prefill: {args.prompt_len}-token prompts, 1 new token (prompt tokens/s)", result["prefill"])
    elif args.task == "logprobs":
        result["logprobs"] = bench_logprobs(args, runner)
        print_table("logprobs: greedy output tokens/s without and with the top 5 per token", result["logprobs"])
    elif args.task == "structured":
        result["structured"] = bench_structured(args, str(path), runner)
        print_table(f"JSON schema vs unconstrained, {args.new_tokens} greedy tokens (tokens/s)", result["structured"])
    elif args.task == "score":
        result["score"] = bench_score(args, str(path), runner)
        print_table("scoring (tokens/s)", result["score"])
    elif args.speculative:
        result["speculative"] = bench_speculative(args, str(path), runner)
        print_table(
            f"speculative decoding ({args.speculative}, speedup over plain decoding in the same run)",
            result["speculative"],
        )
    else:
        result["generate"] = bench_generate(args, str(path), runner)
        print_table("generation (tokens/s)", result["generate"])
        bandwidth = args.peak_bandwidth_gbs or (H200_BANDWIDTH_GBS if runner.device.type == "cuda" else None)
        if bandwidth is not None:
            result["roofline_batch1"] = batch1_roofline(
                runner.model, result["generate"], bandwidth, args.prompt_len + args.new_tokens // 2
            )
    _print_setup(result, args)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _load_runner(args: argparse.Namespace, path: str) -> ModelRunner:
    """The runner the flags ask for, sized for the largest batch (the prefix cache off but for --task prefix)."""
    return ModelRunner.from_pretrained(
        path,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        decode_kernel=args.decode_kernel,
        decode_plan=not args.no_decode_plan,
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
        quantization=args.quantization,
        # Every measurement repeats the same prompts: with the prefix cache on, the timed runs would restore the
        # warm-up's states instead of computing them. Only --task prefix measures the cache (its own twins).
        enable_prefix_caching=args.task == "prefix",
    )


def _describe_run(args: argparse.Namespace, path: str, runner: ModelRunner) -> dict[str, Any]:
    """The result's header: the model, the device and every execution path the runner took."""
    return {
        "model": path,
        "preset": None if args.model else args.preset,
        "device": str(runner.device),
        "dtype": str(runner.dtype),
        "quantization": args.quantization,
        "cpu_kernels": _cpu_kernels(),
        "threads": torch.get_num_threads(),
        "decode_kernel": _decode_kernel(runner),
        "decode_plan": _decode_plan(runner),
        "cuda_graphs": _cuda_graphs(runner),
        "args": vars(args),
    }


def _print_setup(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"threads: {result['threads']}  device: {result['device']}  dtype: {result['dtype']}  "
        f"quantization: {args.quantization or 'none'}  "
        f"decode kernel: {result['decode_kernel']}  decode plan: {result['decode_plan']}  "
        f"CUDA graphs: {result['cuda_graphs']}  CPU kernels: {result['cpu_kernels']}"
    )


def _cpu_kernels() -> str:
    """The native kernels' instruction-set variant and why (`native.describe`), or "none" when none were loaded."""
    return native.describe() if native.loaded() else "none"


def _decode_kernel(runner: ModelRunner) -> str:
    """The decode kernel the runner's recurrent (Mamba2, Gated DeltaNet) layers use ("auto" resolved)."""
    kernels = {m.decode_kernel for m in runner.model.modules() if hasattr(m, "decode_kernel")}
    return ",".join(sorted(kernels)) or "none (no recurrent layers)"


def _decode_plan(runner: ModelRunner) -> str:
    """Whether plain decode steps run as one native call, and why not when they do not."""
    if not runner.decode_plan:
        return "off (--no-decode-plan)"
    reason = unsupported_reason(runner.model)
    return "on" if reason is None else f"off ({reason})"


def _cuda_graphs(runner: ModelRunner) -> str:
    """Whether decode steps run as CUDA graphs (or their eager form, on CPU), and why not when they do not."""
    if not runner.cuda_graphs:
        return "off"
    reason = cuda_graph.unsupported_reason(runner.model)
    if reason is not None:
        return f"off ({reason})"
    return "on" if runner.device.type == "cuda" else "eager form (no CUDA)"


if __name__ == "__main__":
    sys.exit(main())
