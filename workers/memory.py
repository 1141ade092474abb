"""How much memory a runner may use, and how many KV cache blocks that leaves.

On CUDA the budget is vLLM's `gpu_memory_utilization`: the fraction of the device's memory this runner may use
(weights, activations and KV cache together). On CPU it is `max_memory` in bytes, by default 80 % of the memory
available when the runner starts (the driver gives each CPU worker its share of its node instead:
`pipeline/placement.py`). The KV cache gets what the weights, the recurrent state slots and the
activations of one forward (bounded by `max_num_batched_tokens`) leave. On CPU the cache is reserved, not touched:
blocks are paged in as requests use them, so the budget bounds memory rather than claiming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

import torch

from workers.model.checkpoint.config import ATTENTION, ATTENTION_KINDS, RECURRENT_KINDS, SHARED_ATTENTION, HybridConfig
from workers.model.distributed.group import Collectives
from workers.model.kernels.selective_scan import CHUNK_ELEMENTS
from workers.model.state import DEFAULT_BLOCK_SIZE
from workers.spec_decode.mtp import pending_bytes

CPU_DEFAULT_FRACTION = 0.8
PREFIX_CHECKPOINTS_PER_SEQ = 4  # prefix cache: recurrent state checkpoints per slot (templates, their variants)
PREFIX_CHECKPOINT_SHARE = 0.1  # … at most this share of the memory the weights and slots leave
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "ki": 1024, "mi": 1024**2, "gi": 1024**3,
          "ti": 1024**4}  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    """What a runner's memory budget holds: bytes in all, bytes spoken for before any KV, and the KV blocks."""

    budget_bytes: int
    reserved_bytes: int  # weights + state slots + one forward's activations
    bytes_per_block: int  # one KV block across every cache that pages over it (target, draft, MTP head)
    num_kv_blocks: int  # the null block included
    num_prefix_checkpoints: int = 0  # recurrent state checkpoints of the prefix cache …
    prefix_checkpoint_bytes: int = 0  # … and their bytes (inside reserved_bytes)


def parse_memory_size(value: str | int | float) -> int:
    """Bytes from `12GB`, `12GiB`, `512MiB`, `1.5g` or a plain number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]i?)?[bB]?\s*", str(value))
        if match is None:
            raise ValueError(f"max_memory={value!r} is invalid: give bytes or a size like 8GB, 8GiB, 512MiB")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size <= 0:
        raise ValueError(f"max_memory={value!r} is invalid: must be more than 0 bytes")
    return size


def available_cpu_memory() -> int:
    """Bytes of memory available to new allocations now (MemAvailable; total physical memory as a fallback)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def runner_budget(device: torch.device, max_memory: int | None, gpu_memory_utilization: float) -> int:
    """Bytes the runner may use in all (weights included)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * gpu_memory_utilization)
    return max_memory if max_memory is not None else int(available_cpu_memory() * CPU_DEFAULT_FRACTION)


def in_use(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes the runner holds already: the device's allocations on CUDA, the weights on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return weight_bytes(model)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor `model`'s modules hold, each storage once: parameters and buffers, and the packed
    weights kept as plain attributes (native panels and scales, a MoE block's packed experts)."""
    storages: dict[int, int] = {}

    def add(value: object) -> None:
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return
        if value.is_mkldnn:  # oneDNN's packed weights (linear_backend="onednn"): an opaque tensor, no storage
            storages[id(value)] = value.numel() * value.element_size()
            return
        storage = value.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            add(tensor)
        for value in vars(module).values():
            add(value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                for field in dataclasses.fields(value):
                    add(getattr(value, field.name))
    return sum(storages.values())


def activation_bytes(config: HybridConfig, max_num_batched_tokens: int, max_logit_rows: int) -> int:
    """An upper estimate of one forward's activations: a few hidden-size and projection-width tensors per token
    of the budget, and float32 logits (with their softmax) for the rows that sample."""
    widths = [config.hidden_size * 6]
    if config.mamba is not None:
        m = config.mamba
        widths.append(3 * (2 * m.intermediate_size + 2 * m.num_groups * m.state_size + m.num_heads))
    if config.gdn is not None:
        g = config.gdn
        widths.append(3 * (g.conv_dim + 2 * g.value_dim + 2 * g.num_value_heads))
    scan_bytes = 0
    if config.mamba1 is not None:  # x, z, conv output, dt, y per token; [b, t, i, n] discretised tensors (3)
        m1 = config.mamba1
        widths.append(3 * (5 * m1.intermediate_size + m1.dt_rank + 2 * m1.state_size))
        scan_bytes = 3 * 4 * max(CHUNK_ELEMENTS, max_logit_rows * m1.intermediate_size * m1.state_size)
    if config.kda is not None:  # conv inputs and outputs, the gate and the per-channel decay
        widths.append(3 * (2 * config.kda.conv_dim + 2 * config.kda.qkv_dim))
    ff = config.feed_forward
    widths.append(3 * max(ff.intermediate_size, ff.shared_expert_intermediate_size + ff.expert_intermediate_size))
    per_token = 4 * sum(widths)
    return per_token * max_num_batched_tokens + 3 * 4 * config.vocab_size * max_logit_rows + scan_bytes


def plan_memory(
    models: list[torch.nn.Module],
    device: torch.device,
    dtype: torch.dtype,
    budget: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_speculative_tokens: int,
    mtp: bool = False,
    prefix_caching: bool = False,
) -> MemoryPlan:
    """The KV blocks `budget` bytes leave after the weights (target, draft), the state slots and one forward's
    activations; `mtp` adds the MTP head's KV layers (one per attention block of its layer) to every block.
    `prefix_caching` sets aside state checkpoints for the prefix cache: `PREFIX_CHECKPOINTS_PER_SEQ` per slot, within
    `PREFIX_CHECKPOINT_SHARE` of what the weights and slots leave (its shared KV blocks are the KV cache's own).
    Raises when not even one block is left."""
    config = models[0].config
    used = in_use(models[0], device) if device.type == "cuda" else sum(in_use(m, device) for m in models)
    needed = used + activation_bytes(config, max_num_batched_tokens, max_num_seqs * (num_speculative_tokens + 1))
    needed += sum(state_bytes_per_slot(m.config, dtype) for m in models) * max_num_seqs
    if mtp:  # the target hidden states the MTP proposer holds until its head consumes them
        needed += pending_bytes(config.hidden_size, dtype, max_num_seqs, num_speculative_tokens, max_num_batched_tokens)
    checkpoints = 0
    state_bytes = state_bytes_per_slot(config, dtype)
    if prefix_caching:  # an attention-only model's checkpoints are empty: as many as wanted
        room = int(PREFIX_CHECKPOINT_SHARE * max(0, budget - needed)) // max(1, state_bytes)
        checkpoints = max(0, min(PREFIX_CHECKPOINTS_PER_SEQ * max_num_seqs, room if state_bytes else 1 << 30))
        needed += checkpoints * state_bytes
    per_token = sum(kv_bytes_per_token(m.config, dtype) for m in models)
    per_token += kv_bytes_per_token(config, dtype, num_layers=config.mtp_block_kinds.count(ATTENTION)) if mtp else 0
    per_block = per_token * DEFAULT_BLOCK_SIZE
    limit = "gpu_memory_utilization" if device.type == "cuda" else "max_memory"
    if per_token == 0:  # no attention layer: nothing grows with the sequence, but the rest must fit
        if needed > budget:
            raise ValueError(
                f"{limit} is too small: the budget is {budget / 2**30:.2f} GiB, weights + state slots + "
                f"activations of {max_num_batched_tokens} batched tokens need {needed / 2**30:.2f} GiB; raise "
                f"{limit} or lower max_num_batched_tokens / max_num_seqs"
            )
        return MemoryPlan(budget, needed, per_block, 1 << 40, checkpoints, checkpoints * state_bytes)
    if budget - needed < per_block:
        raise ValueError(
            f"{limit} leaves no room for a KV cache: the budget is {budget / 2**30:.2f} GiB, weights + state "
            f"slots + activations of {max_num_batched_tokens} batched tokens need {needed / 2**30:.2f} GiB; "
            f"raise {limit} or lower max_num_batched_tokens / max_num_seqs"
        )
    blocks = num_kv_blocks(budget - needed, per_block)
    return MemoryPlan(budget, needed, per_block, blocks, checkpoints, checkpoints * state_bytes)


def agree_memory_plan(plan: MemoryPlan, group: Collectives) -> MemoryPlan:
    """The plan every rank of a tensor-parallel group holds: the fewest KV blocks and prefix checkpoints any rank
    has room for (budgets and weights differ by rank — a draft model lives on rank 0 alone), so block tables and
    admission are alike on every rank. One rank: `plan` itself."""
    if group.size == 1:
        return plan
    num_blocks, num_checkpoints = group.all_reduce_min([plan.num_kv_blocks, plan.num_prefix_checkpoints])
    per_checkpoint = plan.prefix_checkpoint_bytes // max(1, plan.num_prefix_checkpoints)
    return dataclasses.replace(
        plan,
        num_kv_blocks=num_blocks,
        num_prefix_checkpoints=num_checkpoints,
        prefix_checkpoint_bytes=per_checkpoint * num_checkpoints,
    )


def num_kv_blocks(free_bytes: int, bytes_per_block: int) -> int:
    """KV blocks (the null block included) that `free_bytes` hold."""
    return 1 + max(0, free_bytes) // max(1, bytes_per_block)


def kv_bytes_per_token(config: HybridConfig, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """KV cache bytes one position takes in `num_layers` attention layers (default: the model's)."""
    if num_layers is None:
        num_layers = sum(kind in ATTENTION_KINDS for kind in config.block_kinds)
        num_layers += config.block_kinds.count(SHARED_ATTENTION)  # Zamba2: each use of a shared block has its KV
    a = config.attention
    return num_layers * a.num_kv_heads * sum(a.cache_widths) * torch.empty(0, dtype=dtype).element_size()


def state_bytes_per_slot(config: HybridConfig, dtype: torch.dtype) -> int:
    """Recurrent state bytes of one slot: conv windows (model dtype) and float32 matrix states."""
    num_layers = sum(kind in RECURRENT_KINDS for kind in config.block_kinds)
    if num_layers == 0:
        return 0
    conv, state = config.recurrent_state_shapes()
    return num_layers * (math.prod(conv) * torch.empty(0, dtype=dtype).element_size() + 4 * math.prod(state))
