"""Benchmark hybridgen against transformers on the same weights and prompts, in one run; prints a table, writes JSON.

python jobs/benchmark.py [--quantization int8] [--task score]  # bench model (hidden 512, 8 layers), CPU; or scoring
python jobs/benchmark.py --task shards --model examples/models/demo-target --batch-sizes 32   # streaming vs drains
python jobs/benchmark.py --task prefix --model examples/models/demo-target --num-rows 64 --new-tokens 16  # prefix cache
python jobs/benchmark.py --model DIR --speculative ngram  # spec decode on copy-heavy prompts vs plain
python jobs/benchmark.py --device cuda --preset granite-4.0-h-1b --batch-sizes 1 16 64 256   # graphs vs eager
python jobs/benchmark.py --task resume --num-shards 2000 100000  # driver bookkeeping: plan, resume, finalize
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.driver_bookkeeping import bench_resume
from bench.generation import (
    H200_BANDWIDTH_GBS,
    PRESETS,
    batch1_roofline,
    build_preset,
    copy_heavy_prompts,
    hf_generate_fn,
    hf_score_fn,
    peak_memory_mb,
    print_table,
    random_prompts,
    reset_peak_memory,
    timed,
)
from bench.job_throughput import bench_prefix, bench_shards
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model.kernels import native
from workers.model.layers.linear import QUANTIZATIONS
from workers.model.loader import DECODE_KERNELS
from workers.model.steps import cuda_graph
from workers.model.steps.decode_plan import unsupported_reason


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Benchmark flags."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--task",
        choices=["generate", "score", "shards", "prefix", "resume"],
        default="generate",
        help="what to measure (shards: a job's rows streamed through one worker against one call per "
        "shard and one call over every row; prefix: a shared-prefix job with the prefix cache on and off, "
        "and distinct prompts; resume: the driver's shard bookkeeping, no model)",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="bench", help="random-weight model shapes")
    p.add_argument("--model", help="a local checkpoint instead of a preset")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="auto", help="weight dtype (auto: float32 on CPU, the checkpoint's on GPU)")
    p.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        default=None,
        help="weight quantization (CPU): int8 block linears per output channel and an int8 LM head (int8), the head "
        "float32 (int8_weight_only), or int8 × int8 everywhere (w8a8)",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="prompts per run")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (score: tokens per row)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--speculative", choices=["ngram", "draft", "mtp"], help="add spec-decode runs on copy-heavy prompts"
    )
    p.add_argument(
        "--prompts",
        help="JSONL with a `prompt` text column to use instead of generated prompts "
        "(speculative runs; tokenized with the model's tokenizer; generation stops at eos)",
    )
    p.add_argument("--prompt-kind", help="only --prompts rows whose `kind` is this (the demo's: copy, continue)")
    p.add_argument(
        "--min-prompts",
        type=int,
        default=1,
        help="speculative runs: at least this many prompts per batch size, run batch-size at a time "
        "(batch 1 over several prompts)",
    )
    p.add_argument("--draft-model", help="draft checkpoint for --speculative draft (default: the model itself)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per step at most")
    p.add_argument(
        "--speculative-policy",
        choices=["adaptive", "fixed", "curve"],
        default="adaptive",
        help="adaptive: drafts per step chosen from measured step times and acceptance; fixed: always "
        "--num-speculative-tokens; curve: fixed k = 1 … --num-speculative-tokens and adaptive, each "
        "against the same plain runs",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--decode-kernel",
        choices=list(DECODE_KERNELS),
        default="auto",
        help="how Mamba2 and Gated DeltaNet decode steps run: auto (native C kernel on CPU float32, else "
        "torch; Triton on CUDA), torch (the reference path), compile (torch.compile; Mamba2 only), native or "
        "triton",
    )
    p.add_argument(
        "--no-decode-plan",
        action="store_true",
        help="run decode steps module by module instead of as one native call (the plan's baseline)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode and verification steps as CUDA graphs (auto: on for CUDA; on, on CPU: their eager "
        "form); when on, the same weights are also measured eagerly in the same run",
    )
    p.add_argument(
        "--peak-bandwidth-gbs",
        type=float,
        default=None,
        help=f"memory bandwidth for the batch-1 roofline share (default: {H200_BANDWIDTH_GBS:.0f}, an "
        "H200's HBM, on CUDA; on CPU only when given)",
    )
    p.add_argument("--num-rows", type=int, default=192, help="--task shards: rows of the job")
    p.add_argument(
        "--shard-rows",
        type=int,
        default=None,
        help="--task shards: rows per shard (default: 2 × the largest --batch-sizes, which is max_num_seqs)",
    )
    p.add_argument("--prefix-len", type=int, default=1500, help="--task prefix: tokens of the shared prefix")
    p.add_argument("--suffix-len", type=int, default=30, help="--task prefix: mean tokens of each row's own suffix")
    p.add_argument(
        "--num-distinct",
        type=int,
        default=1000,
        help="--task prefix: rows of the distinct-prompt run (--prompt-len tokens each)",
    )
    p.add_argument(
        "--num-shards", type=int, nargs="+", default=[100_000], help="--task resume: shards in the plan (one row each)"
    )
    p.add_argument("--json", default="benchmark.json", help="where to write the results")
    return p.parse_args(argv)


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
    draft = (args.draft_model or path) if args.speculative == "draft" else None
    spec_runners = {
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
        times: dict[str, list[float]] = {label: [] for label in engines}
        for _ in range(args.repeats):
            for label, target in engines.items():
                start = time.perf_counter()
                run(target)
                times[label].append(time.perf_counter() - start)
        tokens = sum(len(t) for t in expected)
        plain = statistics.median(times["plain"])
        for label, spec_runner in spec_runners.items():
            after = spec_runner.spec_stats()
            drafts = after["num_draft_tokens"] - before[label]["num_draft_tokens"]
            accepted = after["num_accepted_draft_tokens"] - before[label]["num_accepted_draft_tokens"]
            steps = after["num_drafts"] - before[label]["num_drafts"]
            chosen = {k: n - before[label]["num_steps_by_k"].get(k, 0) for k, n in after["num_steps_by_k"].items()}
            fast = statistics.median(times[label])
            rows.append(
                {
                    "engine": f"hybridgen+{args.speculative}",
                    "policy": label,
                    "batch": batch,
                    "prompts": len(prompts),
                    "identical_to_plain": same[label],
                    "acceptance_rate": accepted / drafts if drafts else 0.0,
                    "mean_accepted_length": 1 + accepted / steps if steps else 1.0,
                    "steps_by_k": " ".join(f"{k}:{n}" for k, n in sorted(chosen.items()) if n),
                    "plain_tokens_per_s": tokens / plain,
                    "spec_tokens_per_s": tokens / fast,
                    "speedup": plain / fast,
                    "decode_speedup": (plain - prefill.seconds) / max(fast - prefill.seconds, 1e-9),
                }
            )
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


def main(argv: list[str] | None = None) -> int:
    """Build or load the model, run the requested measurements, print and save them."""
    args = parse_args(argv)
    if args.task == "resume":
        return bench_bookkeeping(args)
    if args.task == "shards":
        return bench_job_shards(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or build_preset(args.preset, Path(tempfile.gettempdir()) / f"hybridgen-{args.preset}")
    runner = ModelRunner.from_pretrained(
        str(path),
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        decode_kernel=args.decode_kernel,
        decode_plan=not args.no_decode_plan,
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
        quantization=args.quantization,
    )
    result: dict[str, Any] = {"model": str(path), "preset": None if args.model else args.preset,
                              "device": str(runner.device), "dtype": str(runner.dtype),
                              "quantization": args.quantization, "cpu_kernels": _cpu_kernels(),
                              "threads": torch.get_num_threads(), "decode_kernel": _decode_kernel(runner),
                              "decode_plan": _decode_plan(runner), "cuda_graphs": _cuda_graphs(runner),
                              "args": vars(args)}  # fmt: skip
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
    print(
        f"threads: {result['threads']}  device: {result['device']}  dtype: {result['dtype']}  "
        f"quantization: {args.quantization or 'none'}  "
        f"decode kernel: {result['decode_kernel']}  decode plan: {result['decode_plan']}  "
        f"CUDA graphs: {result['cuda_graphs']}  CPU kernels: {result['cpu_kernels']}"
    )
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


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
