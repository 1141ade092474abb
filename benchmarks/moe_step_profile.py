"""One MoE block's step, each way it can run, on this device: prints a table, writes JSON.

The block is built from a preset's shapes (default: Qwen3-Next's at the bench size, 128 experts of 128, top 8, a
gated shared expert) with random weights, and timed per step at each batch size:
- `eager`: the PyTorch form that sorts on the host (one pair of matmuls per used expert; a sync per expert on CUDA);
- `grouped`: the static form (routing on the device, `torch._grouped_mm` over rows sorted by expert) — what a CUDA
  graph captures; on CUDA also `graph`, that form captured and replayed;
- `native` (CPU): the experts packed in float32, int8 and bfloat16 panels, routing and experts in `csrc/moe.c`.
Times are medians of `--repeats` runs after a warm-up; the table also gives the experts' bytes each step reads and
the rate at which it reads them (a decode step is bound by them).

python benchmarks/moe_step_profile.py --batch-sizes 1 8 32 --json moe_step.json
python benchmarks/moe_step_profile.py --device cuda --dtype bfloat16 --batch-sizes 1 16 64 256
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.model.checkpoint.config import FeedForwardConfig, HybridConfig
from workers.model.kernels import native
from workers.model.layers.linear import prepare_linears
from workers.model.layers.moe import MoE, grouped_gemm_fits

SHAPES = {  # feed-forward shapes: hidden size, experts, top k, expert width, shared width, router, shared gate
    "qwen3-next-bench": (512, FeedForwardConfig(0, True, False, 128, 8, 128, 512, shared_expert_gate=True)),
    "moe-bench": (512, FeedForwardConfig(0, True, False, 32, 4, 256, 512, norm_topk_prob=True)),
    "nemotron-like": (
        512,
        FeedForwardConfig(0, False, False, 128, 6, 256, 512, "sigmoid", 8, 4, True, 2.5),
    ),
}


def build_block(hidden_size: int, ff: FeedForwardConfig, device: torch.device, dtype: torch.dtype) -> MoE:
    """A MoE block with random weights (scaled so activations stay O(1))."""
    config = HybridConfig.__new__(HybridConfig)
    object.__setattr__(config, "hidden_size", hidden_size)
    object.__setattr__(config, "feed_forward", ff)
    torch.manual_seed(0)
    block = MoE(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 10))
    return block.to(device=device, dtype=dtype).eval()


def time_step(step: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of `step()` after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graphed(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`step` captured as a CUDA graph (a warm-up on a side stream first, PyTorch's recipe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def variants(block: MoE, device: torch.device, dtype: torch.dtype) -> dict[str, MoE]:
    """The ways this device runs the block, by name."""
    out = {"eager": block}
    if grouped_gemm_fits(device, dtype):
        out["grouped"] = block
    if device.type == "cpu" and dtype == torch.float32 and native.available():
        for weight_format, name in ((None, "native float32"), ("int8", "native int8"), ("bfloat16", "native bf16")):
            packed = copy.deepcopy(block)
            prepare_linears(packed, "native", device, dtype, weight_format)
            out[name] = packed
    return out


def expert_bytes(block: MoE, batch: int) -> int:
    """The bytes of experts a step of `batch` tokens reads, in the block's weight format, when its tokens pick
    distinct experts (an upper bound: at most every expert)."""
    ff, packed = block.router.ff, block.packed
    parts = [block.experts_up[0], block.experts_down[0]] if packed is None else [packed.up[0], packed.down[0]]
    per_expert = sum(t.numel() * t.element_size() for t in parts)
    return min(ff.num_experts, batch * ff.experts_per_token) * per_expert


def row_of(form: str, batch: int, seconds: float, module: MoE) -> dict[str, Any]:
    """One table row: the step's milliseconds and the rate it reads its experts at."""
    return {
        "form": form,
        "batch": batch,
        "ms": seconds * 1e3,
        "expert_gb_s": expert_bytes(module, batch) / seconds / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    """Time the MoE block's forms per batch size; print a table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-next-bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hidden_size, ff = SHAPES[args.shape]
    block = build_block(hidden_size, ff, device, dtype)
    forms = variants(block, device, dtype)
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            x = torch.randn(batch, hidden_size, device=device, dtype=dtype)
            for name, module in forms.items():
                static = name == "grouped"
                step = lambda module=module, static=static: module(x, static_shapes=static)  # noqa: E731
                seconds = time_step(step, args.repeats, device)
                if name == "grouped" and device.type == "cuda":
                    rows.append(row_of("graph", batch, time_step(graphed(step), args.repeats, device), module))
                rows.append(row_of(name, batch, seconds, module))
    print(
        f"{args.shape}: {ff.num_experts} experts of {ff.expert_intermediate_size}, top {ff.experts_per_token}, "
        f"hidden {hidden_size}; {device} {args.dtype}, {args.threads} threads; median ms per step"
    )
    print(f"{'form':>15} {'batch':>6} {'ms':>9} {'expert GB/s':>12}")
    for row in rows:
        print(f"{row['form']:>15} {row['batch']:>6} {row['ms']:>9.3f} {row['expert_gb_s']:>12.1f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "shape": args.shape,
                    "device": str(device),
                    "dtype": args.dtype,
                    "threads": args.threads,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
