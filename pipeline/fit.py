"""The preflight's sizing: before any worker starts, does the model fit the GPUs it will get?

`check_fit` sizes one rank (`workers/sizing.py`: weights in their format, state slots, KV for one full-length row,
one forward's activations) against `--gpu-memory-utilization` × the device's memory, taken from `--gpu-memory`, else
`ACCELERATOR_MEMORY` of `--accelerator-type` or of the cluster's GPU nodes (Ray reports no GPU memory), and refuses
with one line naming the smallest `--tensor-parallel-size` (and format) that fits, or the largest `--max-num-seqs`
that does. `pipeline/generate.py` and `pipeline/score.py` check what they can when the job is built (the split and,
with a known device, the fit); the driver checks the fit on the cluster's GPU types once connected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.preflight import hybrid_config, looks_local

# Memory of one GPU by Ray's `accelerator_type`: the totals nvidia-smi reports, in MiB (Ray reports no GPU memory).
# Ray's "A100" without a size is taken as the 40 GB one, so that a refusal never overstates the room.
ACCELERATOR_MIB = {"H100": 81559, "H200": 143771, "H20": 97871, "B200": 183359, "A100-80G": 81920}
ACCELERATOR_MIB |= {"A100-40G": 40960, "A100": 40960, "L40S": 46068, "L40": 46068, "L4": 23034, "A10G": 23028}
ACCELERATOR_MIB |= {"A10": 23028, "T4": 15360, "V100": 16384}
ACCELERATOR_MEMORY = {name: mib * 2**20 for name, mib in ACCELERATOR_MIB.items()}
DEFAULT_GPUS_PER_NODE = 8  # the largest T the refusal suggests when no GPU node is up to count


class ModelDoesNotFit(ValueError):
    """The preflight's sizing refused the job: one line naming what would fit."""


@dataclass(frozen=True)
class FitRequest:
    """What each worker asks of its GPUs, for `check_fit` (`fit_request` builds it from the job's flags)."""

    model: str
    raw_config: dict[str, Any]
    weight_format: str  # one of workers.sizing.WEIGHT_FORMATS
    dtype: str  # of everything not kept in FP8, the state's conv windows and the KV cache
    checkpoint_fp8: bool  # a block-wise FP8 checkpoint: `--quantization fp8` is a choice
    tensor_parallel_size: int
    expert_parallel: bool
    mtp: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int
    gpu_memory_utilization: float


def read_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """config.json of a local model directory, or of a hub repo at the commit `revision` (`check_model` checked it)."""
    if looks_local(model):
        return json.loads((Path(model).expanduser() / "config.json").read_text())
    import huggingface_hub

    return json.loads(Path(huggingface_hub.hf_hub_download(model, "config.json", revision=revision)).read_text())


def check_parallel(model: str, raw: dict[str, Any], tensor_parallel_size: int, expert_parallel: bool) -> None:
    """`ValueError` naming the model and the field when `tensor_parallel_size` ranks cannot split it."""
    from workers.model.distributed.layout import check_divisible

    config = hybrid_config(raw)
    if expert_parallel and not config.feed_forward.num_experts:
        raise ValueError(f"model {model!r}: --enable-expert-parallel is for MoE models; this one has no experts")
    try:
        check_divisible(config, tensor_parallel_size, expert_parallel)
    except ValueError as error:
        raise ValueError(f"model {model!r}: --tensor-parallel-size {tensor_parallel_size}: {error}") from None


def weight_format(raw: dict[str, Any], dtype: str, quantization: str) -> tuple[str, str]:
    """(weights' format, dtype of the rest) on a GPU worker for `--dtype` / `--quantization`."""
    from workers.model.loader import DTYPES

    if dtype == "auto":
        declared = raw.get("torch_dtype") or raw.get("dtype") or (raw.get("text_config") or {}).get("torch_dtype")
        dtype = declared if declared in DTYPES else "float32"
    if quantization == "fp8":
        return "fp8", dtype
    return ("int8" if quantization != "none" else dtype), dtype


def _need(request: FitRequest, fmt: str, size: int, num_seqs: int) -> tuple[int, int]:
    """(bytes one rank needs in all, of them its weights) at `size` ranks, weights in `fmt`, `num_seqs` slots."""
    from workers.sizing import size_model

    model = size_model(request.raw_config, fmt, size, request.expert_parallel, request.mtp, request.dtype)
    rows = num_seqs * (request.num_speculative_tokens + 1)
    total = model.weight_bytes_per_rank + model.activation_bytes(request.max_num_batched_tokens, rows)
    total += num_seqs * model.state_bytes_per_slot + request.max_model_len * model.kv_bytes_per_token
    return total, model.weight_bytes_per_rank


def _splits(request: FitRequest, size: int) -> bool:
    try:
        check_parallel(request.model, request.raw_config, size, request.expert_parallel)
    except ValueError:
        return False
    return True


def _smallest_size(request: FitRequest, fmt: str, budget: int, sizes: range) -> tuple[int, int] | None:
    """(T, bytes per GPU) of the smallest size in `sizes` that splits the model and fits, or None."""
    for size in sizes:
        if _splits(request, size):
            total, _ = _need(request, fmt, size, request.max_num_seqs)
            if total <= budget:
                return size, total
    return None


def _most_seqs(request: FitRequest, budget: int) -> int:
    """The largest --max-num-seqs (0 … asked) that fits at the asked size and format."""
    low, high = 0, request.max_num_seqs
    while low < high:
        middle = (low + high + 1) // 2
        if _need(request, request.weight_format, request.tensor_parallel_size, middle)[0] <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def check_fit(request: FitRequest, device_memory: int, device: str, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> int:
    """Bytes one rank needs (weights in their format, `max_num_seqs` state slots, KV for one `max_model_len` row,
    one forward's activations) against `gpu_memory_utilization × device_memory`; `ModelDoesNotFit` with one line
    naming the smallest --tensor-parallel-size (and format) that fits, or the largest --max-num-seqs that does."""
    budget, size, fmt = (
        int(request.gpu_memory_utilization * device_memory),
        request.tensor_parallel_size,
        request.weight_format,
    )
    total, weights = _need(request, fmt, size, request.max_num_seqs)
    if total <= budget:
        return total
    label = {"fp8": "FP8", "int8": "int8"}.get(fmt, fmt)
    what = (
        f"model {request.model!r}: {label} weights need {_gb(weights)} per GPU at --tensor-parallel-size {size} "
        f"({_gb(total)} with {request.max_num_seqs} state slots, KV for {request.max_model_len} tokens and "
        f"activations); {device} may use {_gb(budget)} ({request.gpu_memory_utilization:g} × {_gb(device_memory)})"
    )
    larger = _smallest_size(request, fmt, budget, range(size + 1, gpus_per_node + 1))
    kept = None
    if request.checkpoint_fp8 and fmt != "fp8":  # the checkpoint's own FP8 is the other format to name
        kept = _smallest_size(request, "fp8", budget, range(1, gpus_per_node + 1))
    options = [f"--tensor-parallel-size {larger[0]} fits ({_gb(larger[1])} per GPU)"] if larger else []
    if kept and (larger is None or kept[0] < larger[0]):
        options.append(f"--quantization fp8 --tensor-parallel-size {kept[0]} fits ({_gb(kept[1])} per GPU)")
    seqs = _most_seqs(request, budget)
    if seqs >= 1:
        also = f"; --tensor-parallel-size {larger[0]} fits {request.max_num_seqs}" if larger else ""
        raise ModelDoesNotFit(f"{what}: --max-num-seqs {seqs} fits at --tensor-parallel-size {size}{also}")
    if options:
        raise ModelDoesNotFit(f"{what}: {', or '.join(options)}")
    fp8 = " (a block-wise FP8 checkpoint with --quantization fp8 halves bf16 weights)" if fmt != "fp8" else ""
    raise ModelDoesNotFit(f"{what}: no --tensor-parallel-size up to {gpus_per_node} (GPUs per node) fits{fp8}")


def fit_request(
    model: Any, scaling: Any, raw: dict[str, Any], mtp: bool = False, num_speculative_tokens: int = 0
) -> FitRequest:
    """The sizing request of a job's workers from its model (`pipeline.config.ModelConfig`) and scaling sections."""
    from workers.sizing import checkpoint_is_fp8

    fmt, dtype = weight_format(raw, model.dtype, model.quantization)
    config = hybrid_config(raw)
    return FitRequest(
        model=model.model,
        raw_config=raw,
        weight_format=fmt,
        dtype=dtype,
        checkpoint_fp8=checkpoint_is_fp8(raw),
        tensor_parallel_size=scaling.tensor_parallel_size,
        expert_parallel=scaling.enable_expert_parallel,
        mtp=mtp,
        max_num_seqs=model.max_num_seqs,
        max_num_batched_tokens=model.max_num_batched_tokens,
        max_model_len=model.max_model_len or config.max_position_embeddings,
        num_speculative_tokens=num_speculative_tokens,
        gpu_memory_utilization=model.gpu_memory_utilization,
    )


def known_device_memory(gpu_memory: int | None, accelerator_type: str | None) -> tuple[int, str] | None:
    """(bytes of one GPU, how the refusal names it) from --gpu-memory, else --accelerator-type; None: unknown."""
    if gpu_memory is not None:
        return gpu_memory, f"a GPU of --gpu-memory {_gb(gpu_memory)}"
    if accelerator_type in ACCELERATOR_MEMORY:
        return ACCELERATOR_MEMORY[accelerator_type], f"an {accelerator_type} worker"
    return None


def cluster_device_memory(nodes: list[dict[str, float]]) -> tuple[int, str, int] | None:
    """(bytes of one GPU, its name, GPUs per node) of the GPU nodes' `accelerator_type:NAME` resources: the smallest
    known type, since Ray may place a worker on any of them; None when no GPU node names a known type."""
    known = [
        (ACCELERATOR_MEMORY[name.split(":", 1)[1]], name.split(":", 1)[1], int(node.get("GPU", 0)))
        for node in nodes
        if node.get("GPU", 0) > 0
        for name in node
        if name.startswith("accelerator_type:") and name.split(":", 1)[1] in ACCELERATOR_MEMORY
    ]
    if not known:
        return None
    memory, name, _ = min(known)
    return memory, f"an {name} worker", max(gpus for m, _, gpus in known if m == memory)


def check_job_fit(
    model: Any, scaling: Any, revision: str | None = None, mtp: bool = False, num_speculative_tokens: int = 0
) -> FitRequest | None:
    """At build time (after `check_model`): `ValueError` when --tensor-parallel-size cannot split the model, and
    `ModelDoesNotFit` when a known GPU (--gpu-memory, --accelerator-type) cannot hold a rank. Returns the request
    for the driver to check on the cluster's GPU types (None: checked here, or CPU workers)."""
    raw = read_config(model.model, revision)
    check_parallel(model.model, raw, scaling.tensor_parallel_size, scaling.enable_expert_parallel)
    if model.device == "cpu":
        return None  # CPU workers size their KV cache from --max-memory when they start
    request = fit_request(model, scaling, raw, mtp, num_speculative_tokens)
    memory = known_device_memory(model.gpu_memory_bytes, scaling.accelerator_type)
    if memory is None:
        return request
    check_fit(request, *memory)
    return None


def check_on_cluster(request: FitRequest, nodes: list[dict[str, float]]) -> str | None:
    """The driver's check once connected, with the GPU nodes' accelerator types; `ModelDoesNotFit` when a rank does
    not fit. Returns a line to print when the sizing is skipped (no node names a known GPU)."""
    memory = cluster_device_memory(nodes)
    if memory is None:
        return (
            f"preflight: no GPU node names an accelerator type of known memory ({', '.join(ACCELERATOR_MEMORY)}): "
            "sizing skipped (give --gpu-memory to size the model before the workers start)"
        )
    check_fit(request, *memory)
    return None
