"""The flags of `jobs/benchmark.py`, in groups: the model, the runs, speculation, the execution paths, the tasks."""

from __future__ import annotations

import argparse

from bench.generation import H200_BANDWIDTH_GBS, PRESETS
from workers.model.layers.linear import QUANTIZATIONS
from workers.model.loader import DECODE_KERNELS


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """jobs/benchmark.py's flags."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _model_arguments(p)
    _run_arguments(p)
    _speculative_arguments(p)
    _path_arguments(p)
    _task_arguments(p)
    return p.parse_args(argv)


def _model_arguments(p: argparse.ArgumentParser) -> None:
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


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="prompts per run")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (score: tokens per row)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _speculative_arguments(p: argparse.ArgumentParser) -> None:
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


def _path_arguments(p: argparse.ArgumentParser) -> None:
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


def _task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        choices=["generate", "prefill", "score", "shards", "prefix", "resume", "logprobs", "n", "structured", "tp"],
        default="generate",
        help="what to measure (prefill: long prompts that generate one token, prompt tokens/s; logprobs: tokens/s "
        "with --logprobs 5 against none; shards: a job's rows streamed through one worker against one call per "
        "shard and one call over every row; prefix: a shared-prefix job with the prefix cache on and off, "
        "and distinct prompts; resume: the driver's shard bookkeeping, no model; n: --n samples per prompt against "
        "duplicated rows, for each --batch-sizes prompts; structured: JSON-schema constrained vs unconstrained "
        "tokens/s, plain and with n-gram and draft speculation; tp: collective calls, bytes and seconds per decode "
        "step at each --tensor-parallel-sizes beside the unsplit model's)",
    )
    p.add_argument(
        "--tensor-parallel-sizes", type=int, nargs="+", default=[2, 4], help="--task tp: ranks to split over"
    )
    p.add_argument("--link-gbs", type=float, default=360.0, help="--task tp: GPU link bandwidth on paper (GB/s)")
    p.add_argument("--link-latency-us", type=float, default=8.0, help="--task tp: latency per collective on paper")
    p.add_argument("--n", type=int, default=8, help="--task n: samples per prompt")
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
