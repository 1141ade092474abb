"""How much device memory one rank of a worker needs, from a checkpoint's config.json alone (no weights, no device).

The driver's preflight (`pipeline/preflight.py`) calls `size_model` before any worker starts. It builds the
**rank-0 local** model on the meta device from `shard_config` (the same local config the ranks, `StatePool` and the
memory plan use, so the preflight, the loader and the runtime agree by construction) and sums, parameter by
parameter, its elements times their bytes in the chosen weight format:

- `fp8` (a block-wise FP8 checkpoint kept in FP8): the linears' and experts' weights at 1 byte plus one float32 scale
  per 128 × 128 block. These stay in the run's dtype: everything that is not a linear weight (norms, conv, `A_log`,
  `D`, `dt_bias`, biases), the embedding and LM head, routers and shared-expert gates, the modules the checkpoint's
  `quantization_config.modules_to_not_convert` names (a module kind named in any layer counts in every layer), and a
  split weight whose local slice does not fall on 128-element blocks (the loader dequantizes it).
- `bfloat16` / `float16` / `float32`: 2 / 2 / 4 bytes; `int8` (CPU): linear weights at 1 byte plus a float32 scale
  per output row, the rest float32.
- The loader's float32 parameters (`FLOAT32_SUFFIXES`; the RMSNorm weights of zero-centred checkpoints) at 4 bytes.

Rank 0 is the largest rank: it holds the row-parallel biases, and every rank holds `ceil(V / T)` vocabulary rows.
State per slot, KV per token and activations come from `workers/memory.py`'s functions on the local config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.memory import activation_bytes, kv_bytes_per_token, state_bytes_per_slot
from workers.model import HybridConfig
from workers.model.checkpoint.tensors import fp8_block_size
from workers.model.distributed.layout import TensorParallel, check_divisible, shard_config, vocab_shard_size
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.norm import RMSNorm
from workers.model.loader import DTYPES, FLOAT32_SUFFIXES

WEIGHT_FORMATS = ("fp8", "bfloat16", "float16", "float32", "int8")
FP8_BLOCK = 128
EXPERT_STACKS = ("experts_up", "experts_down")
# Never converted to FP8 by the published checkpoints, nor kept FP8 by the loader: our module names.
ALWAYS_UNCONVERTED = ("embed_tokens", "lm_head", "router", "shared_gate")
# A `modules_to_not_convert` entry's last HF module name → our parameter names it covers (fused where we fuse).
HF_MODULE_NAMES = {
    "gate": ("router",),  # the MoE router (`mlp.gate`)
    "shared_expert_gate": ("shared_gate",),
    "in_proj_ba": ("in_proj",),
    "in_proj_b": ("in_proj",),
    "in_proj_a": ("in_proj",),
    "in_proj_qkvz": ("in_proj",),
    "in_proj_qkv": ("in_proj",),
    "in_proj_z": ("in_proj",),
    "gate_proj": ("up_proj",),
    "up_proj": ("up_proj",),
}


@dataclass(frozen=True)
class ModelSize:
    """What one rank (rank 0, the largest) of a worker holds, in bytes."""

    weight_bytes_per_rank: int
    state_bytes_per_slot: int  # recurrent state of one request slot (this rank's heads)
    kv_bytes_per_token: int  # KV cache of one position (this rank's KV heads; replicated ones count in full)
    num_params: int  # parameters of the whole model (every rank), the check that the config was read right
    fp8_bytes_per_rank: int  # of the weights, those kept in FP8 (scales included)
    local_config: HybridConfig

    def activation_bytes(self, num_tokens: int, num_logit_rows: int = 0) -> int:
        """One forward's activations at `num_tokens` batched tokens and `num_logit_rows` rows that sample
        (`workers.memory.activation_bytes` on the local config; the logits are full width on every rank)."""
        return activation_bytes(self.local_config, num_tokens, num_logit_rows)


def checkpoint_is_fp8(raw_config: dict[str, Any]) -> bool:
    """Whether config.json describes a block-wise FP8 checkpoint (`quantization_config.quant_method == "fp8"`)."""
    return fp8_block_size(raw_config) is not None


def size_model(
    raw_config: dict[str, Any],
    weight_format: str,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
    mtp: bool = False,
    dtype: str = "bfloat16",
) -> ModelSize:
    """The per-rank size of the model config.json `raw_config` describes, at `tensor_parallel_size` ranks, weights
    in `weight_format` (one of WEIGHT_FORMATS) and everything else in `dtype`. `ValueError` naming the field when the
    size does not split the model (`check_divisible`)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r} is invalid: must be one of {', '.join(WEIGHT_FORMATS)}")
    config = HybridConfig.from_hf_dict(raw_config)
    check_divisible(config, tensor_parallel_size, expert_parallel)
    tp = TensorParallel(0, tensor_parallel_size, expert_parallel)
    local = shard_config(config, tp)
    base_dtype = torch.float32 if weight_format in ("int8", "float32") else DTYPES[dtype]
    if weight_format in ("bfloat16", "float16"):
        base_dtype = DTYPES[weight_format]
    global_model, local_model = _meta_model(config, mtp), _meta_model(local, mtp)
    global_shapes = {name: tuple(p.shape) for name, p in global_model.named_parameters()}
    unconverted = _unconverted(raw_config)
    linears = {f"{name}.weight" for name, m in local_model.named_modules() if isinstance(m, nn.Linear)}
    float32 = _float32_names(local_model, config)
    total = fp8 = 0
    for name, param in local_model.named_parameters():
        shape = _rank_shape(name, tuple(param.shape), config, tp)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        kept_fp8 = weight_format == "fp8" and _stays_fp8(name, shape, global_shapes[name], linears, unconverted)
        size = _param_bytes(name, shape, weight_format, kept_fp8, name in linears, name in float32, base_dtype)
        total += size
        fp8 += size if kept_fp8 else 0
    num_params = sum(p.numel() for name, p in global_model.named_parameters())
    num_params -= global_model.lm_head.weight.numel() if config.tie_word_embeddings else 0
    return ModelSize(
        weight_bytes_per_rank=total,
        state_bytes_per_slot=state_bytes_per_slot(local, base_dtype),
        kv_bytes_per_token=kv_bytes_per_token(local, base_dtype),
        num_params=num_params,
        fp8_bytes_per_rank=fp8,
        local_config=local,
    )


def _meta_model(config: HybridConfig, mtp: bool) -> HybridModel:
    with torch.device("meta"):
        return HybridModel(config, mtp=mtp)


def _rank_shape(name: str, shape: tuple[int, ...], config: HybridConfig, tp: TensorParallel) -> tuple[int, ...]:
    """A parameter's shape on rank 0 where the local config alone does not give it: the vocabulary-parallel
    embedding and LM head (`ceil(V / T)` rows) and the expert-parallel expert stacks (`E / T` experts)."""
    if name in ("embed_tokens.weight", "lm_head.weight") and shape[0] == config.vocab_size:
        return (vocab_shard_size(config.vocab_size, tp), *shape[1:])
    experts = config.feed_forward.num_experts
    if tp.expert_parallel and name.endswith(EXPERT_STACKS) and shape[0] == experts:
        return (experts // tp.size, *shape[1:])
    return shape


def _unconverted(raw_config: dict[str, Any]) -> set[str]:
    """Our module names that `quantization_config.modules_to_not_convert` keeps out of FP8, plus those no published
    FP8 checkpoint converts."""
    names = set(ALWAYS_UNCONVERTED)
    quantization = raw_config.get("quantization_config") or {}
    for entry in quantization.get("modules_to_not_convert") or ():
        last = str(entry).rstrip(".").split(".")[-1]
        names.update(HF_MODULE_NAMES.get(last, (last,)))
    return names


def _stays_fp8(
    name: str, shape: tuple[int, ...], global_shape: tuple[int, ...], linears: set[str], unconverted: set[str]
) -> bool:
    """A linear weight or expert stack that the checkpoint stores in FP8 and whose local slice is block-aligned."""
    if name not in linears and not name.endswith(EXPERT_STACKS):
        return False
    if any(part in unconverted for part in name.split(".")):
        return False
    # The blocks tile each matrix (an expert's, for a stack): its two dims, not the expert count, must stay aligned.
    return all(n == g or n % FP8_BLOCK == 0 for n, g in zip(shape[-2:], global_shape[-2:], strict=True))


def _float32_names(model: HybridModel, config: HybridConfig) -> set[str]:
    """Parameters the loader keeps in float32 whatever the dtype (`empty_model`)."""
    names = {name for name, _ in model.named_parameters() if name.endswith(FLOAT32_SUFFIXES)}
    if config.zero_centred_norms:
        for module_name, module in model.named_modules():
            if isinstance(module, RMSNorm):
                names.update(f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters())
    return names


def _param_bytes(
    name: str,
    shape: tuple[int, ...],
    weight_format: str,
    kept_fp8: bool,
    is_linear: bool,
    is_float32: bool,
    base_dtype: torch.dtype,
) -> int:
    """Bytes of one parameter of `shape` in its format."""
    numel = math.prod(shape)
    if kept_fp8:  # e4m3 bytes and a float32 scale per 128 × 128 block of each (expert's) matrix
        rows, cols = shape[-2:]
        matrices = math.prod(shape[:-2])
        return numel + 4 * matrices * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    if is_float32:
        return 4 * numel
    if weight_format == "int8" and is_linear and not name.startswith("embed_tokens"):
        return numel + 4 * shape[0]  # int8 weights and a float32 scale per output row
    return numel * torch.empty(0, dtype=base_dtype).element_size()
