"""The engine's configuration: one frozen dataclass per concern, each default and each list of allowed values
written here once (vLLM's names), built once from the flags and passed whole to the worker, the runner and the
scheduler.

`EngineConfig` gathers the sections: `LoadConfig` (how the model is loaded), `SchedulerConfig` (how many requests
and tokens a step takes), `CacheConfig` (KV cache memory and prefix caching), `ExecutionConfig` (decode plans and
CUDA graphs), `SamplerConfig` (what the sampler reports), `ParallelConfig` (threads, tensor parallelism) and the `SpeculativeConfig` of
`workers/spec_decode/config.py`. Sampling defaults are `workers.SamplingParams`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from workers.logprobs import LOGPROBS_MODES, RAW, logprobs_mode_name
from workers.memory import DEFAULT_GPU_MEMORY_UTILIZATION, parse_memory_size
from workers.model.layers.fp8_linear import KEEP_FP8
from workers.model.layers.linear import LINEAR_BACKENDS
from workers.model.layers.linear import QUANTIZATIONS as LINEAR_QUANTIZATIONS
from workers.model.loader import DECODE_KERNELS, DTYPES

__all__ = ["DECODE_KERNELS", "DEVICES", "LINEAR_BACKENDS", "LOAD_DTYPES", "QUANTIZATIONS"]
from workers.spec_decode import SpeculativeConfig

# The load's quantizations: the linears' int8 formats (CPU), and "fp8": a block-wise FP8 checkpoint kept in FP8.
QUANTIZATIONS = (*LINEAR_QUANTIZATIONS, KEEP_FP8)

DEVICES = ("auto", "cuda", "cpu")
LOAD_DTYPES = ("auto", *DTYPES)


def _check(cls: str, name: str, ok: bool, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{cls}.{name}={value!r} is invalid: must be {allowed}")


@dataclass(frozen=True)
class LoadConfig:
    """How the model is loaded: where, in which dtype, quantized or not, through which kernels. The loader checks
    the values against the lists it runs (`load_checkpoint`), naming the allowed ones."""

    device: str = "cpu"  # one of DEVICES, or a torch device such as "cuda:1"; "auto": CUDA when there is one
    dtype: str = "float32"  # "auto": float32 on CPU, the checkpoint's on GPU
    quantization: str | None = None  # vLLM's name; one of QUANTIZATIONS (CPU float32), or "fp8": a block-wise FP8
    # checkpoint's linears kept in FP8 (any device; `workers/model/layers/fp8_linear.py`)
    revision: str | None = None  # a hub model's branch, tag or commit (the driver pins a commit)
    linear_backend: str = "auto"  # one of LINEAR_BACKENDS (see `workers/model/layers/linear.py`)
    decode_kernel: str = "auto"  # one of DECODE_KERNELS (see `workers/model/loader.py`)


@dataclass(frozen=True)
class SchedulerConfig:
    """How much one step takes: requests decoded together, new tokens per forward, tokens per request."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096  # long prompts are prefilled, long sequences scored, in chunks of this many
    max_model_len: int | None = None  # prompt + generated tokens per request (None: the model's limit)

    def __post_init__(self) -> None:
        ok = isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1
        _check("SchedulerConfig", "max_num_seqs", ok, self.max_num_seqs, "an integer ≥ 1")
        ok = isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1
        _check("SchedulerConfig", "max_num_batched_tokens", ok, self.max_num_batched_tokens, "an integer ≥ 1")
        ok = self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1)
        _check("SchedulerConfig", "max_model_len", ok, self.max_model_len, "an integer ≥ 1 or None")


@dataclass(frozen=True)
class CacheConfig:
    """The memory that weights, activations and the KV cache may use, and prefix caching (`workers/memory.py`)."""

    enable_prefix_caching: bool = True  # requests sharing a prompt prefix compute it once (`workers/prefix_cache.py`)
    max_memory: int | str | None = None  # CPU: bytes or a size like "8GB" (None: 80 % of what is available)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # CUDA: vLLM's fraction of device memory

    def __post_init__(self) -> None:
        value = self.gpu_memory_utilization
        ok = isinstance(value, (int, float)) and 0 < value <= 1
        _check("CacheConfig", "gpu_memory_utilization", ok, value, "in (0, 1]")
        if self.max_memory is not None:
            parse_memory_size(self.max_memory)  # ValueError naming the value

    @property
    def max_memory_bytes(self) -> int | None:
        """`max_memory` in bytes (None: not given)."""
        return None if self.max_memory is None else parse_memory_size(self.max_memory)


@dataclass(frozen=True)
class ExecutionConfig:
    """How decode and verification steps execute (`workers/executors.py`)."""

    decode_plan: bool = True  # the CPU decode plan, one native call per step, where the model allows
    cuda_graphs: bool | None = None  # None: on for CUDA devices, off elsewhere (True on CPU: their eager form)


@dataclass(frozen=True)
class SamplerConfig:
    """What the sampler reports beside the tokens (`workers/logprobs.py`)."""

    # vLLM's name and values: "raw_logprobs" (the model's log-softmax) or "processed_logprobs" (of the distribution
    # each row samples from: temperature, top-k, top-p); "raw" and "processed" are taken for them.
    logprobs_mode: str = RAW

    def __post_init__(self) -> None:
        name = logprobs_mode_name(self.logprobs_mode)
        allowed = f"one of {', '.join(LOGPROBS_MODES)} (or raw, processed)"
        _check("SamplerConfig", "logprobs_mode", name is not None, self.logprobs_mode, allowed)
        object.__setattr__(self, "logprobs_mode", name)


@dataclass(frozen=True)
class ParallelConfig:
    """How a worker's work is spread: torch threads on CPU, and tensor parallelism — the model split over
    `tensor_parallel_size` ranks, one process each, rank 0 the caller's (`workers/distributed/`)."""

    num_threads: int | None = None  # torch threads per rank (None: torch's choice; followers: the leader's / T)
    tensor_parallel_size: int = 1  # vLLM's name: ranks the model is split over (GPUs on CUDA, processes on CPU)
    enable_expert_parallel: bool = False  # vLLM's name: MoE experts divided among the ranks instead of split
    rank_timeout_s: float = 60.0  # a collective waiting this long on a silent rank fails (`RankFailure`)
    # Tests only: every rank loads the whole unsplit model (its collectives the identity) while the T rank processes
    # and their lockstep run for real, to check the control path apart from the split layers.
    replicate_model: bool = False

    def __post_init__(self) -> None:
        ok = self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1)
        _check("ParallelConfig", "num_threads", ok, self.num_threads, "an integer ≥ 1 or None")
        size = self.tensor_parallel_size
        ok = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        _check("ParallelConfig", "tensor_parallel_size", ok, size, "an integer ≥ 1")
        ok = isinstance(self.enable_expert_parallel, bool)
        _check("ParallelConfig", "enable_expert_parallel", ok, self.enable_expert_parallel, "True or False")
        value = self.rank_timeout_s
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        _check("ParallelConfig", "rank_timeout_s", ok, value, "a number of seconds > 0")
        ok = isinstance(self.replicate_model, bool)
        _check("ParallelConfig", "replicate_model", ok, self.replicate_model, "True or False")


@dataclass(frozen=True)
class EngineConfig:
    """Everything a runner and its scheduler are configured by, one section per concern."""

    load: LoadConfig = field(default_factory=LoadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None  # None: plain decoding

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per step at most (0 without speculative decoding)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def replace(self, **options: Any) -> EngineConfig:
        """This config with fields of its sections replaced by name (`max_num_seqs=8`, `decode_plan=False`,
        `speculative=...`); `TypeError` naming an unknown one. Each field name belongs to one section."""
        sections: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            if name == "speculative":
                continue
            section = _SECTION_OF.get(name)
            if section is None:
                raise TypeError(f"{name!r} is not an engine option: the options are {', '.join(sorted(_SECTION_OF))}")
            sections.setdefault(section, {})[name] = value
        changed = {s: dataclasses.replace(getattr(self, s), **values) for s, values in sections.items()}
        if "speculative" in options:
            changed["speculative"] = options["speculative"]
        return dataclasses.replace(self, **changed)


_SECTIONS = {
    "load": LoadConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "execution": ExecutionConfig,
    "sampler": SamplerConfig,
    "parallel": ParallelConfig,
}
_SECTION_OF = {f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
