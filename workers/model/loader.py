"""Load a hybrid checkpoint: a local HF model directory or a hub repo id, safetensors only, no remote code; the whole
model, or one tensor-parallel rank's share of it (`load_checkpoint(..., tp=...)`)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.model.checkpoint.config import HybridConfig
from workers.model.checkpoint.families import MTP_MODEL_TYPES
from workers.model.checkpoint.tensors import CheckpointTensors, fp8_block_size
from workers.model.checkpoint.weights import mtp_head_keys
from workers.model.decode_kernel import DECODE_KERNELS as DECODE_KERNELS
from workers.model.decode_kernel import prepare_decode_kernel
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, check_divisible
from workers.model.distributed.slices import qualified_rules
from workers.model.fp8_shards import Fp8Shards
from workers.model.kernels import heap, native
from workers.model.layers import fp8_experts, fp8_linear
from workers.model.layers.fp8_linear import Fp8BlockLinear
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.linear import check_quantization, prepare_linears
from workers.model.layers.mtp import check_mtp_layout, mtp_pattern
from workers.model.layers.norm import RMSNorm
from workers.model.weight_fill import Sharding, load_weights, parameter_rules
from workers.model.weight_fill import match_weights as match_weights

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Parameters kept in float32 whatever the weight dtype (tiny, and precision-critical in the SSM).
FLOAT32_SUFFIXES = ("A_log", ".D", "dt_bias", "e_score_correction_bias")
# The quantizations that include the LM head. "int8_weight_only" leaves it in float32: measured on the demo prompts
# (200, 64 greedy tokens), a per-channel int8 head took greedy agreement with float32 from 96.5 % to 92.8 %. "int8"
# and "w8a8" quantize it per group of inputs and recompute each row's top logits in float32 (linear_w8a8.py).
QUANTIZED_HEADS = ("int8", "w8a8")
# What we fetch from the hub: configs, safetensors, tokenizer files. Never code, never pickles.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass(frozen=True)
class LoadSummary:
    """What one rank's load read and kept: checkpoint bytes read, bytes held in FP8 (weights and scales), and the
    FP8 weights dequantized because the rank's cut of them is off the 128 × 128 blocks."""

    rank: int = 0
    size: int = 1
    bytes_read: int = 0
    fp8_kept_bytes: int = 0
    fp8_dequantized: tuple[str, ...] = ()

    def line(self) -> str:
        """One log line."""
        text = f"rank {self.rank}/{self.size} read {self.bytes_read / 1e6:.1f} MB of checkpoint data"
        if self.fp8_kept_bytes or self.fp8_dequantized:
            text += f"; {self.fp8_kept_bytes / 1e6:.1f} MB kept in FP8"
        if self.fp8_dequantized:
            names = ", ".join(self.fp8_dequantized[:3]) + (", …" if len(self.fp8_dequantized) > 3 else "")
            text += f"; {len(self.fp8_dequantized)} FP8 weights dequantized (cut off the 128-blocks: {names})"
        return text


@dataclass
class LoadedCheckpoint:
    """A model with its weights, the directory it came from, its raw generation config, and what the load read.
    `config` is the checkpoint's (the whole model's); a rank's model holds its share (`model.config` after S2)."""

    model: HybridModel
    config: HybridConfig
    directory: Path
    generation_config: dict[str, Any]
    summary: LoadSummary = LoadSummary()


def resolve_model_dir(path_or_repo: str, revision: str | None = None) -> Path:
    """A local model directory as is, or a hub repo id downloaded (configs, safetensors, tokenizer files only)."""
    if os.path.isdir(path_or_repo):
        return Path(path_or_repo)
    if os.path.exists(path_or_repo) or path_or_repo.count("/") != 1:
        raise ValueError(f"model {path_or_repo!r} is neither a model directory nor a hub repo id ('org/name')")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path_or_repo, revision=revision, allow_patterns=HUB_PATTERNS))


def resolve_dtype(name: str, config: HybridConfig, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto': float32 on a CPU, else the checkpoint's declared dtype (float32 when it declares none).

    CPUs compute in float32 whatever the checkpoint stores: PyTorch's bfloat16 matmuls ran at 0.55–0.68× of our
    float32, and float32 keeps every row's result independent of how many rows a forward has — which greedy
    speculative decoding needs to equal plain decoding token for token (torch's bfloat16 matmuls round a [b, k+1]
    verification differently from [b, 1] decode steps). An explicit "bfloat16" on CPU means bfloat16 linear weights
    with float32 activations where the native kernels build (`resolve_weight_format`)."""
    if name == "auto":
        on_cpu = torch.device(device).type == "cpu"
        name = "float32" if on_cpu or config.torch_dtype not in DTYPES else config.torch_dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_weight_format(
    dtype: torch.dtype, quantization: str | None, device: str | torch.device, linear_backend: str
) -> tuple[torch.dtype, str | None]:
    """(compute dtype, linear weight format) for the resolved `dtype` and the user's `quantization`.

    bfloat16 on a CPU with the native kernels ("auto" or "native" linears): bfloat16 linear weights (the blocks' and
    the LM head's, csrc/linear_bf16.c on the CPU's AMX / AVX512-BF16 units) and float32 for everything else, so the
    native Mamba2 / GDN / attention kernels and the decode plan run as in float32. Without a compiler, or with
    linear_backend "torch" / "onednn", bfloat16 stays the all-PyTorch bfloat16 model. int8 with bfloat16: ValueError.
    """
    if quantization is not None and dtype == torch.bfloat16:
        raise ValueError(
            f"quantization={quantization!r} cannot be combined with dtype='bfloat16': int8 quantizes "
            "from float32 weights; pick one (dtype 'auto' or 'float32' for int8)"
        )
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return dtype, quantization
    if linear_backend == "native":
        native.load()  # raises NativeKernelError with the compiler's message
    if linear_backend == "native" or (linear_backend == "auto" and native.available()):
        return torch.float32, "bfloat16"
    return dtype, quantization


def open_tensors(directory: Path, fp8_block: tuple[int, int] | None = None) -> CheckpointTensors:
    """The checkpoint's tensors (read on demand, FP8 weights dequantized with blocks of `fp8_block`)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {directory} (found: {found}); "
            "hybridgen loads safetensors weights only"
        )
    return CheckpointTensors([directory / name for name in files], fp8_block)


def check_mtp_head(config: HybridConfig, keys: Any, directory: Path | str) -> None:
    """An MTP head is served for the Qwen GDN families and Nemotron-H, in the layouts `check_mtp_layout` accepts,
    and the checkpoint (its tensor names `keys`) must carry its weights; `ValueError` naming what is missing or
    unsupported otherwise. Reads no tensor data."""
    if config.model_type not in MTP_MODEL_TYPES:
        raise ValueError(
            f"speculative method 'mtp' is supported for {', '.join(MTP_MODEL_TYPES)}, not {config.model_type!r}"
        )
    check_mtp_layout(config)
    expected = mtp_head_keys(config)
    if not any(key.startswith("mtp.") for key in keys):
        raise ValueError(
            f"speculative method 'mtp' needs the checkpoint's multi-token-prediction head, but {directory} has no "
            f"mtp.* weights (expected {', '.join(expected)}, …); use method 'ngram' or 'draft' for this model"
        )
    missing = [key for key in expected if key not in keys]
    if missing:
        raise ValueError(
            f"the multi-token-prediction head in {directory} does not match its config (MTP pattern "
            f"{mtp_pattern(config)!r}): missing {', '.join(missing)}"
        )


def empty_model(
    config: HybridConfig,
    mtp: bool,
    dtype: torch.dtype,
    device: str | torch.device,
    on_meta: Callable[[HybridModel], Any] | None = None,
    tp: TensorParallel = SINGLE_TP,
) -> HybridModel:
    """The model's modules on `device` with uninitialised weights in `dtype` (the weights that stay float32 in
    float32), the LM head tied to the embeddings where the config says so; `on_meta(model)` changes the modules
    before any memory is allocated (FP8 kept linears). `tp`: rank `tp.rank`'s share of the model."""
    with torch.device("meta"):
        model = build_model(config, mtp, tp)
    if on_meta is not None:
        on_meta(model)
    model = model.to(dtype).to_empty(device=device)
    for name, param in model.named_parameters():
        if name.endswith(FLOAT32_SUFFIXES):
            param.data = param.data.float()
    if config.zero_centred_norms:  # 1 + w is rounded once, in float32, as the reference computes it
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.float()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def build_model(config: HybridConfig, mtp: bool, tp: TensorParallel = SINGLE_TP) -> HybridModel:
    """`HybridModel` of the global `config`, rank `tp.rank`'s share of it when `tp` splits it (on the current
    device: the loader builds it on meta)."""
    return HybridModel(config, mtp=mtp, tp=tp)


@dataclass
class Fp8Kept:
    """With quantization "fp8": the weights that stay FP8 — linears (`Fp8Shards`, cut along the 128-blocks for this
    rank) and MoE experts (`layers/fp8_experts.py`) — chosen on the meta model and filled once it is on its device."""

    shards: Fp8Shards
    handles: CheckpointTensors
    reference: HybridModel | None  # the whole model on meta when this rank holds a share (the checkpoint's shapes)
    tp: TensorParallel
    directory: Path
    expert_keys: set[str] = field(default_factory=set)  # the checkpoint keys of the experts kept in FP8

    def keep_on_meta(self, meta_model: HybridModel) -> None:
        """Swap the kept linears and experts of `meta_model` (nothing allocated yet) for their FP8 forms."""
        handles = self.handles
        plan = match_weights(meta_model if self.reference is None else self.reference, dict(handles.shapes))
        kept = fp8_linear.fp8_kept_sources(plan, handles)
        experts = fp8_experts.keep_fp8_experts(meta_model, plan, handles)  # `MoE.fp8_experts`, cut for this rank
        self.expert_keys.update(key for keys in experts.values() for key in keys)
        fp8_linear.check_fp8_checkpoint(handles.fp8_block, len(kept) + len(experts), self.directory)
        self.shards.choose(kept, qualified_rules(meta_model) if self.tp.parallel else {})
        fp8_linear.keep_fp8_linears(meta_model, self.shards.kept, self.shards)

    def fill(self, model: HybridModel) -> None:
        """Read the kept weights' bytes and scales into `model` (on its device)."""
        fp8_linear.fill_fp8_linears(model, self.shards.kept, self.shards)
        fp8_experts.fill_fp8_experts(model, self.handles)  # and logs the bytes kept in FP8 (if any)

    def checkpoint_keys(self) -> set[str]:
        """The checkpoint keys read as kept FP8 weights, which the generic load skips."""
        return self.shards.checkpoint_keys() | self.expert_keys


def load_checkpoint(
    path_or_repo: str,
    device: str | torch.device = "cpu",
    dtype: str = "auto",
    linear_backend: str = "auto",
    decode_kernel: str = "auto",
    mtp: bool = False,
    revision: str | None = None,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE_TP,
) -> LoadedCheckpoint:
    """Read config.json, build the model on `device` in `dtype` and load its safetensors weights.

    `linear_backend`: "auto" (the native kernel on CPU float32 when it builds, else oneDNN-packed weights; torch
    elsewhere), "torch", "onednn" or "native".
    `decode_kernel`: how the recurrent layers' decode steps run — "auto" (the native C kernel on CPU float32, Triton
    on CUDA when it imports, else torch), "torch" (the reference), "compile", "native" or "triton"; see
    `prepare_decode_kernel`. `mtp`: also load the checkpoint's
    multi-token-prediction head (`model.mtp`); `ValueError` before any weight is read when it has none.
    `revision`: a hub repo's branch, tag or commit (default main). `quantization`: None (the weights in `dtype`)
    or "int8" (CPU: linear weights quantized per output channel as they load; see `prepare_linears`).
    dtype="bfloat16" on CPU: bfloat16 linear weights, float32 elsewhere (`resolve_weight_format`). Block-wise
    FP8 checkpoints load dequantized (`tensors.py`), or with `quantization="fp8"` (vLLM's name; any device and
    dtype; 128 × 128 blocks) their linears stored as one FP8 tensor stay FP8 (`layers/fp8_linear.py`): one byte
    per weight, the GEMM dequantizing per tile on CUDA; so do MoE experts (`layers/fp8_experts.py`);
    projections fused off 128-row blocks load dequantized.
    `tp`: load rank `tp.rank`'s share of a model split over `tp.size` ranks: the layers' `shard_rules` say which
    rows and columns each parameter keeps, the checkpoint is checked against the whole model, and this rank reads
    only its rows where the layout allows (`shard_reads.py`; every rank reads the files itself). A kept FP8
    weight whose share is off the 128 × 128 blocks loads dequantized (`fp8_shards.py`); `summary` says so.
    """
    directory = resolve_model_dir(path_or_repo, revision)
    raw_config = _read_json(directory, "config.json", required=True)
    config = HybridConfig.from_hf_dict(raw_config)
    check_divisible(config, tp.size, tp.expert_parallel)
    keep_fp8 = quantization == fp8_linear.KEEP_FP8
    quantization = None if keep_fp8 else quantization
    torch_dtype, weight_format = resolve_weight_format(
        resolve_dtype(dtype, config, device), quantization, device, linear_backend
    )
    check_quantization(quantization, device, torch_dtype)
    handles = open_tensors(directory, fp8_block_size(raw_config))
    if mtp:
        check_mtp_head(config, handles, directory)
    reference = None  # the whole model on meta, which the checkpoint must match, when this rank holds a share
    if tp.parallel:
        with torch.device("meta"):
            reference = build_model(config, mtp)
    fp8 = Fp8Kept(Fp8Shards(handles, tp.rank), handles, reference, tp, directory)
    model = empty_model(config, mtp, torch_dtype, device, fp8.keep_on_meta if keep_fp8 else None, tp)
    fp8.fill(model)
    device = torch.device(device)
    replaced: dict = {}  # shared Linears (Zamba2) are replaced once across the blocks

    def prepare(module: torch.nn.Module, weights: str | None = weight_format) -> str:
        backend = prepare_linears(module, linear_backend, device, torch_dtype, weights, replaced, weight_format)
        heap.return_freed_memory()
        return backend

    sharding = None if reference is None else Sharding(reference, parameter_rules(model), tp.rank)
    load_weights(model, handles, prepare, fp8.checkpoint_keys(), sharding)
    head_format = weight_format if weight_format == "bfloat16" or weight_format in QUANTIZED_HEADS else None
    prepare(model, head_format)  # the LM head (and an MTP head's linears): bfloat16, int8 and w8a8 too; its experts
    # take the blocks' format
    prepare_decode_kernel(model, decode_kernel, torch.device(device), torch_dtype)
    model.eval().requires_grad_(False)
    summary = _summary(tp, handles, model, fp8.shards)
    logger.info("loaded %s: %s", directory.name, summary.line())
    return LoadedCheckpoint(model, config, directory, _read_json(directory, "generation_config.json"), summary)


def _read_json(directory: Path, name: str, required: bool = False) -> dict[str, Any]:
    """`directory / name` parsed; {} when it is absent, `FileNotFoundError` when it is `required`."""
    path = directory / name
    if not path.exists():
        if required:
            raise FileNotFoundError(f"no {name} in {directory}")
        return {}
    return json.loads(path.read_text())


def _summary(tp: TensorParallel, tensors: CheckpointTensors, model: HybridModel, fp8: Fp8Shards) -> LoadSummary:
    kept = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    kept_bytes = sum(t.numel() * t.element_size() for m in kept for t in (m.weight, m.scale_inv))
    return LoadSummary(tp.rank, tp.size, tensors.bytes_read, kept_bytes, tuple(fp8.dequantized))
