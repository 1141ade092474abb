"""Load a hybrid checkpoint: a local HF model directory or a hub repo id, safetensors only, no remote code."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.model.checkpoint.config import HybridConfig
from workers.model.checkpoint.families import MTP_MODEL_TYPES
from workers.model.checkpoint.tensors import CheckpointTensors, fp8_block_size, without_scales
from workers.model.checkpoint.weights import Source, checkpoint_sources, is_ignored, mtp_head_keys
from workers.model.kernels import heap, native, triton_kernels
from workers.model.layers import fp8_experts, fp8_linear
from workers.model.layers.attention import Attention
from workers.model.layers.feed_forward import MLP
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.linear import check_quantization, prepare_linears
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.mtp import check_mtp_layout, mtp_pattern
from workers.model.layers.norm import RMSNorm
from workers.model.layers.shared_block import SharedBlockUse
from workers.model.layers.short_conv import ShortConvMixer

# Mixers with Triton decode steps besides Mamba2 and Gated DeltaNet (`decode_kernel` "triton" selects them).
TRITON_STEP_MIXERS = (Mamba1Mixer, KimiDeltaAttentionMixer, ShortConvMixer)
DECODE_KERNELS = ("auto", "torch", "compile", "native", "triton")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Parameters kept in float32 whatever the weight dtype (tiny, and precision-critical in the SSM).
FLOAT32_SUFFIXES = ("A_log", ".D", "dt_bias", "e_score_correction_bias")
# The quantizations that include the LM head. "int8_weight_only" leaves it in float32: measured on the demo prompts
# (200, 64 greedy tokens), a per-channel int8 head took greedy agreement with float32 from 96.5 % to 92.8 %. "int8"
# and "w8a8" quantize it per group of inputs and recompute each row's top logits in float32 (linear_w8a8.py).
QUANTIZED_HEADS = ("int8", "w8a8")
# What we fetch from the hub: configs, safetensors, tokenizer files. Never code, never pickles.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass
class LoadedCheckpoint:
    """A model with its weights, the directory it came from, and its raw generation config."""

    model: HybridModel
    config: HybridConfig
    directory: Path
    generation_config: dict[str, Any]


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


def _open_shards(directory: Path, fp8_block: tuple[int, int] | None = None) -> CheckpointTensors:
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


def _pick(sources: list[Source], available: dict[str, Any]) -> Source | None:
    return next((s for s in sources if all(k in available for k in s.keys)), None)


def _read(source: Source, tensors_in: CheckpointTensors) -> torch.Tensor:
    tensors = [tensors_in.read(key) for key in source.keys]
    if source.transform is not None:
        return source.transform(tensors)
    if source.combine == "cat":
        return torch.cat(tensors, dim=0)
    if source.combine == "stack":
        return torch.stack(tensors, dim=0)
    return tensors[0]


def match_weights(
    model: HybridModel, shapes: dict[str, tuple[int, ...]], preloaded: Collection[str] = ()
) -> dict[str, Source]:
    """Parameter name → where it comes from, given the checkpoint's key → shape (its safetensors headers); the keys
    `preloaded` are read otherwise (FP8 kept: `layers/fp8_linear.py`).

    One `ValueError` listing every missing, extra or mis-shaped key; reads no tensor data.
    """
    config = model.config
    shapes = without_scales(shapes)  # an FP8 weight's block scales are read with it
    sources = checkpoint_sources(config, set(shapes))
    params = dict(model.named_parameters(remove_duplicate=False))
    if config.tie_word_embeddings:
        params.pop("lm_head.weight")
    problems, used = [], set(preloaded)
    plan = {}
    for name, param in params.items():
        options = sources.get(name, [])
        source = _pick(options, shapes)
        if source is None:  # name what is missing from the layout the checkpoint comes closest to
            closest = max(options, key=lambda s: sum(k in shapes for k in s.keys), default=None)
            wanted = [k for k in closest.keys if k not in shapes][:2] if closest else []
            problems.append(f"missing weight {wanted or name} for parameter {name!r} of shape {tuple(param.shape)}")
            continue
        used.update(source.keys)
        plan[name] = source
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # a tied checkpoint may still carry a copy
    for key in sorted(set(shapes) - used):
        if not is_ignored(key):
            problems.append(f"unexpected weight {key!r} with shape {tuple(shapes[key])} in the checkpoint")
    for name, source in plan.items():
        plain = source.combine == "one" and source.transform is None
        expected = source.shapes or ((tuple(params[name].shape),) if plain else ())
        for key, shape in zip(source.keys, expected):
            found = tuple(shapes[key])
            if found != tuple(shape):
                problems.append(f"weight {key!r} has shape {found} in the checkpoint, model expects {tuple(shape)}")
        if source.cat_shape is not None:
            found = [tuple(shapes[key]) for key in source.keys]
            joined = (sum(shape[0] for shape in found), *found[0][1:]) if found else ()
            if any(shape[1:] != found[0][1:] for shape in found) or joined != tuple(source.cat_shape):
                problems.append(
                    f"weights {list(source.keys)} have shapes {found} in the checkpoint; concatenated "
                    f"they must give {tuple(source.cat_shape)}"
                )
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"checkpoint does not match the {config.model_type} architecture:\n  {shown}")
    return plan


def load_weights(
    model: HybridModel,
    tensors: CheckpointTensors,
    prepare: Callable[[torch.nn.Module], Any] | None = None,
    preloaded: Collection[str] = (),
) -> None:
    """Fill every parameter from the checkpoint; one `ValueError` listing every missing, extra or mis-shaped key.

    `prepare(block)` is called on each block as soon as its parameters are filled (the loader packs or quantizes
    its linears there), so that the checkpoint's layout of one block at a time, not of the whole model, is held
    beside the packed weights."""
    plan = match_weights(model, dict(tensors.shapes), preloaded)
    params = dict(model.named_parameters(remove_duplicate=False))
    blocks: dict[str, list[str]] = {}  # block prefix → its parameters, in plan order
    for name in plan:
        if name.startswith("blocks."):
            blocks.setdefault(_block_of(name), []).append(name)
    with torch.no_grad():
        for name, source in plan.items():
            plain = source.combine == "one" and source.transform is None
            if not (plain and tensors.read_into(source.keys[0], params[name].data)):  # else read, then copied
                tensor = _read(source, tensors)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"weight {source.keys} has combined shape {tuple(tensor.shape)}, model expects {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor)
                del tensor
            block = _block_of(name)
            if prepare is not None and block in blocks and name == blocks[block][-1]:
                for done in blocks[block]:  # no reference left to the weights `prepare` replaces
                    params.pop(done)
                prepare(model.get_submodule(block))


def _block_of(name: str) -> str:
    """'blocks.3' for 'blocks.3.mixer.in_proj.weight'."""
    return ".".join(name.split(".")[:2])


def prepare_decode_kernel(model: torch.nn.Module, kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """Choose how `model` runs its decode steps (Mamba2, Mamba1 and Gated DeltaNet mixers, attention, norms, MLPs); returns
    the choice made.

    "torch": the reference PyTorch path. "compile": the SSM update fused by `torch.compile` (any device; compiles
    at first use). "native": the C kernels of `workers/model/kernels/csrc` (CPU, float32; built at first use) for the
    Mamba2, Gated DeltaNet and Kimi Delta Attention steps (KDA prompts too), the attention and latent attention
    decode steps and the per-token elementwise work around them (RMSNorm fused with the residual add, the MLP's
    silu(gate) · up, Zamba2's gelu(gate) · up). "triton": the fused Triton kernels of
    `workers/model/kernels/triton_kernels` for the Mamba2, Gated DeltaNet, Mamba1, Kimi Delta Attention and short conv
    decode steps and their state shifts after verification (CUDA; CPU only under TRITON_INTERPRET=1). "auto": native
    where it applies and builds, triton on CUDA where triton imports, else torch.
    """
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={kernel!r} is invalid: must be one of {', '.join(DECODE_KERNELS)}")
    device = torch.device(device)
    native_fits = device.type == "cpu" and dtype == torch.float32
    if kernel == "native":
        if not native_fits:
            raise ValueError(f"decode_kernel='native' needs a CPU and float32 weights, not {device} / {dtype}")
        native.load()  # raises NativeKernelError with the compiler's message
    if kernel == "triton" and not triton_kernels.available(device):
        raise ValueError(f"decode_kernel='triton' cannot run here: {triton_kernels.unavailable_reason(device)}")
    if kernel == "auto":
        if native_fits and native.available():
            kernel = "native"
        elif device.type == "cuda" and triton_kernels.available(device):
            kernel = "triton"
        else:
            kernel = "torch"
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            fused = kernel in ("native", "triton")  # their fused gated norm is rmsnorm(y · silu(z)) only
            module.decode_kernel = "torch" if fused and not module.config.fused_kernels_fit else kernel
        elif isinstance(module, GatedDeltaNetMixer):
            module.decode_kernel = kernel if kernel in ("native", "triton") else "torch"  # no compiled GDN step
        elif isinstance(module, KimiDeltaAttentionMixer):  # native (C, CPU float32), triton (below) or torch
            module.decode_kernel = "native" if kernel == "native" else "torch"
        elif isinstance(module, Mamba1Mixer):  # native (C, CPU float32), triton (below) or the torch reference
            module.decode_kernel = "native" if kernel == "native" else "torch"
        elif isinstance(module, ShortConvMixer):
            module.decode_kernel = "native" if kernel == "native" else "torch"  # "triton": set below
        elif isinstance(module, (RMSNorm, MLP, Attention, SharedBlockUse, MultiHeadLatentAttention)):
            module.native = kernel == "native"  # the per-token elementwise work goes native along with it
        if kernel == "triton" and isinstance(module, TRITON_STEP_MIXERS):
            module.decode_kernel = "triton"  # their one-token steps and state shifts (kernels/triton_kernels)
    return kernel


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
) -> HybridModel:
    """The model's modules on `device` with uninitialised weights in `dtype` (the weights that stay float32 in
    float32), the LM head tied to the embeddings where the config says so; `on_meta(model)` changes the modules
    before any memory is allocated (FP8 kept linears)."""
    with torch.device("meta"):
        model = HybridModel(config, mtp=mtp)
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


def load_checkpoint(
    path_or_repo: str,
    device: str | torch.device = "cpu",
    dtype: str = "auto",
    linear_backend: str = "auto",
    decode_kernel: str = "auto",
    mtp: bool = False,
    revision: str | None = None,
    quantization: str | None = None,
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
    per weight, the GEMM dequantizing per tile on CUDA; so do MoE experts (`layers/fp8_experts.py`); projections
    fused off 128-row blocks load dequantized.
    """
    directory = resolve_model_dir(path_or_repo, revision)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"no config.json in {directory}")
    raw_config = json.loads(config_path.read_text())
    config = HybridConfig.from_hf_dict(raw_config)
    keep_fp8 = quantization == fp8_linear.KEEP_FP8
    quantization = None if keep_fp8 else quantization
    torch_dtype, weight_format = resolve_weight_format(
        resolve_dtype(dtype, config, device), quantization, device, linear_backend
    )
    check_quantization(quantization, device, torch_dtype)
    handles = _open_shards(directory, fp8_block_size(raw_config))
    if mtp:
        check_mtp_head(config, handles, directory)
    kept: dict[str, tuple[str, ...]] = {}  # parameter → its FP8 checkpoint keys, with quantization "fp8"

    def keep_fp8_on_meta(meta_model: HybridModel) -> None:
        plan = match_weights(meta_model, dict(handles.shapes))
        kept.update(fp8_linear.fp8_kept_sources(plan, handles))
        kept.update(fp8_experts.keep_fp8_experts(meta_model, plan, handles))  # `MoE.fp8_experts`
        fp8_linear.check_fp8_checkpoint(handles.fp8_block, len(kept), directory)
        fp8_linear.keep_fp8_linears(meta_model, kept, handles)

    model = empty_model(config, mtp, torch_dtype, device, keep_fp8_on_meta if keep_fp8 else None)
    fp8_linear.fill_fp8_linears(model, kept, handles)
    fp8_experts.fill_fp8_experts(model, handles)  # and logs the bytes kept in FP8 (if any)
    device = torch.device(device)
    replaced: dict = {}  # shared Linears (Zamba2) are replaced once across the blocks

    def prepare(module: torch.nn.Module, weights: str | None = weight_format) -> str:
        backend = prepare_linears(module, linear_backend, device, torch_dtype, weights, replaced, weight_format)
        heap.return_freed_memory()
        return backend

    load_weights(model, handles, prepare, {key for keys in kept.values() for key in keys})
    head_format = weight_format if weight_format == "bfloat16" or weight_format in QUANTIZED_HEADS else None
    prepare(model, head_format)  # the LM head (and an MTP head's linears): bfloat16, int8 and w8a8 too; its experts
    # take the blocks' format
    prepare_decode_kernel(model, decode_kernel, torch.device(device), torch_dtype)
    model.eval().requires_grad_(False)
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    return LoadedCheckpoint(model, config, directory, generation)
