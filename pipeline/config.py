"""Typed job configuration, one frozen dataclass per concern; every default is written here, once.

The CLI (`pipeline/cli.py`) builds its flags from these fields, so a flag's default and help text come from the
field that defines it. The scaling section is `pipeline/scaling_config.py`'s, the score job's `pipeline/score_config.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.fields import doc, fail
from pipeline.sampling_options import logit_bias_flag, token_ids_flag
from pipeline.scaling_config import ScalingConfig
from workers.chat import check_chat_options
from workers.config import DEVICES, LOAD_DTYPES, CacheConfig, SamplerConfig, SchedulerConfig
from workers.config import QUANTIZATIONS as WORKER_QUANTIZATIONS
from workers.logprobs import LOGPROBS_MODES, logprobs_mode_name
from workers.reasoning import REASONING_PARSERS
from workers.sampling import MAX_LOGPROBS, SamplingParams
from workers.spec_decode import SpeculativeConfig, registry
from workers.spec_decode.policy import POLICIES

# The workers' lists (`workers/config.py`), as flags spell them: "none" for no quantization or speculation.
DTYPES = LOAD_DTYPES
QUANTIZATIONS = ("none", *WORKER_QUANTIZATIONS)
SPECULATIVE_METHODS = ("none", *registry.method_names())
SPECULATIVE_POLICIES = POLICIES


@dataclass(frozen=True)
class InputConfig:
    """Where the rows come from and which columns hold what."""

    input: str = doc(
        "hub dataset name, local Parquet/JSONL/CSV file, directory or glob, or a save_to_disk directory", default=""
    )
    split: str = doc("dataset split to read", default="train")
    prompt_column: str | None = doc("column with raw prompt text", default=None)
    messages_column: str | None = doc("column with chat messages (list of {role, content})", default=None)
    sampling_params_column: str | None = doc(
        "column whose values (a struct, or JSON text of an object) override the sampling flags for that row: any "
        "SamplingParams field by its vLLM name (temperature, seed, max_tokens, stop, logprobs, structured_outputs "
        '{"json"|"regex"|"choice"|"grammar": …}, …); a bad value is that row\'s error; a row\'s seed replaces seed + i',
        default=None,
    )
    id_column: str | None = doc(
        "column whose values become the output `id` (default: the input's `id` column if it "
        "has one, else the row index)",
        default=None,
    )

    def __post_init__(self) -> None:
        if not self.input:
            fail("InputConfig", "input", self.input, "give a dataset name, file, directory or glob")


@dataclass(frozen=True)
class ModelConfig:
    """Which model each worker loads and how."""

    model: str = doc("local HF model directory or hub repo id (safetensors only)", default="")
    revision: str | None = doc(
        "hub repo ids: the branch, tag or commit to load (vLLM's name); the driver resolves it "
        "to a commit once and every worker loads that commit (default: main)",
        default=None,
    )
    device: str = doc(
        f"worker device: {', '.join(DEVICES)} (auto: GPU actors when the cluster has GPUs)", default="auto"
    )
    dtype: str = doc(
        f"weight dtype: {', '.join(DTYPES)} (auto: float32 on CPU, the checkpoint's on GPU; bfloat16 on CPU: bf16 "
        "linear weights on the AMX / AVX512-BF16 kernels, float32 activations and states)",
        default="auto",
    )
    quantization: str = doc(
        "weight quantization (vLLM's name): none, int8 (CPU workers: linear weights quantized "
        "at load, per output channel, the LM head per group; ~4× less to read per decode step; "
        "log-probs move slightly, see docs), int8_weight_only (the same, the LM head float32) or w8a8 "
        "(int8 weights × int8 activations everywhere); fp8: a block-wise FP8 checkpoint's linears kept in FP8 "
        "(any device; docs/models.md)",
        default="none",
    )
    max_num_seqs: int = doc("requests decoded together per worker", default=SchedulerConfig.max_num_seqs)
    max_model_len: int | None = doc("prompt + generated tokens per row (default: the model's limit)", default=None)
    max_num_batched_tokens: int = doc(
        "new tokens one forward may take (vLLM's name): long prompts are prefilled "
        "and long rows scored in chunks of this many",
        default=SchedulerConfig.max_num_batched_tokens,
    )
    max_memory: str | None = doc(
        "CPU workers: memory each worker's model, activations and KV cache may use, e.g. "
        "8GB or 8GiB, asked of Ray as its `memory` resource (default: the node's Ray memory "
        "divided among the workers its CPUs hold; 80 percent of the memory available when "
        "the worker starts if no node was up to measure); rows wait for KV room, a row that "
        "can never fit gets an error; a worker's --tensor-parallel-size ranks share it equally",
        default=None,
    )
    gpu_memory_utilization: float = doc(
        "GPU workers: fraction of the device's memory a worker may use (vLLM's name and meaning)",
        default=CacheConfig.gpu_memory_utilization,
    )
    gpu_memory: str | None = doc(
        "GPU workers: memory of one GPU, e.g. 80GB or 80GiB, for the preflight's sizing (default: from the "
        "accelerator type, --accelerator-type or the cluster's GPU nodes; unknown: the preflight skips sizing). "
        "A model whose weights, state slots, KV and activations exceed --gpu-memory-utilization of it per rank is "
        "refused before any worker starts, naming the --tensor-parallel-size or --max-num-seqs that fits",
        default=None,
    )
    enforce_eager: bool = doc(
        "GPU workers: run every step eagerly, without CUDA graphs (vLLM's name; graphs are on "
        "by default on CUDA and never used on CPU)",
        default=False,
    )
    enable_prefix_caching: bool = doc(
        "rows that share a prompt prefix (a template, a system prompt) compute it once: "
        "its recurrent states are checkpointed and its KV blocks shared (vLLM's name; "
        "with every speculative method)",
        default=CacheConfig.enable_prefix_caching,
    )

    def __post_init__(self) -> None:
        if not self.model:
            fail("ModelConfig", "model", self.model, "give a model directory or hub repo id")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            fail("ModelConfig", "revision", self.revision, "give a branch, tag or commit of the hub repo")
        if self.device not in DEVICES:
            fail("ModelConfig", "device", self.device, f"must be one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            fail("ModelConfig", "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            fail("ModelConfig", "quantization", self.quantization, f"must be one of {', '.join(QUANTIZATIONS)}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            fail("ModelConfig", "max_num_seqs", self.max_num_seqs, "must be an integer ≥ 1")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            fail("ModelConfig", "max_model_len", self.max_model_len, "must be an integer ≥ 1")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            fail("ModelConfig", "max_num_batched_tokens", self.max_num_batched_tokens, "must be an integer ≥ 1")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            fail("ModelConfig", "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.max_memory is not None:
            from workers.memory import parse_memory_size  # the workers' own rule

            try:
                parse_memory_size(self.max_memory)
            except ValueError:
                fail("ModelConfig", "max_memory", self.max_memory, "give bytes or a size like 8GB, 8GiB, 512MiB")
        if self.gpu_memory is not None:
            from workers.memory import parse_memory_size

            try:
                parse_memory_size(self.gpu_memory)
            except ValueError:
                fail("ModelConfig", "gpu_memory", self.gpu_memory, "give bytes or a size like 80GB, 80GiB")

    @property
    def gpu_memory_bytes(self) -> int | None:
        """`--gpu-memory` in bytes (None: not given)."""
        from workers.memory import parse_memory_size

        return None if self.gpu_memory is None else parse_memory_size(self.gpu_memory)


STRUCTURED_OUTPUT_FLAGS = ("json_schema", "regex", "choice", "grammar")  # SamplingConfig's constraint fields


@dataclass(frozen=True)
class SamplingConfig:
    """vLLM's sampling names; validated again by `workers.SamplingParams`."""

    max_tokens: int = doc("tokens to generate per row at most", default=SamplingParams.max_tokens)
    temperature: float = doc("0 = greedy", default=SamplingParams.temperature)
    top_p: float = doc("nucleus sampling mass, in (0, 1]", default=SamplingParams.top_p)
    top_k: int = doc("sample among the k most likely tokens (0 = off)", default=SamplingParams.top_k)
    seed: int | None = doc(
        "base seed: row i samples with seed + i (modulo 2^64), so results do not depend on "
        "sharding; without it the job draws one, recorded in the manifest as sampling_seed",
        default=None,
    )
    stop: tuple[str, ...] = doc("stop strings (repeat the flag for several)", default=())
    ignore_eos: bool = doc("keep generating past the model's end-of-sequence token", default=SamplingParams.ignore_eos)
    logprobs: int | None = doc(
        f"write each generated token's log-probability and the K most likely tokens' at its position (0 … "
        f"{MAX_LOGPROBS}; columns logprobs and top_logprobs), from the target's own distribution, speculation or not",
        default=SamplingParams.logprobs,
    )
    logprobs_mode: str = doc(
        "with --logprobs: raw (raw_logprobs: the model's log-softmax) or processed (processed_logprobs: of the "
        "distribution each row samples from, after temperature, top-k and top-p; tokens it excludes at -inf)",
        default=SamplerConfig.logprobs_mode,
    )
    n: int = doc("samples per row: an output row each (sample_index), one prefill", default=SamplingParams.n)
    presence_penalty: float = doc(
        "subtract this from the logit of every token the output already holds, in [-2, 2] (vLLM's)",
        default=SamplingParams.presence_penalty,
    )
    frequency_penalty: float = doc(
        "subtract this times its count in the output so far from every token's logit, in [-2, 2] (vLLM's)",
        default=SamplingParams.frequency_penalty,
    )
    repetition_penalty: float = doc(
        "> 0: divide the positive logits and multiply the negative ones of every token in the prompt or the output "
        "(1 = off)",
        default=SamplingParams.repetition_penalty,
    )
    min_p: float = doc(
        "drop tokens less likely than min_p times the most likely one, in [0, 1] (0 = off)",
        default=SamplingParams.min_p,
    )
    min_tokens: int = doc(
        "no eos or --stop-token-ids before this many tokens are generated", default=SamplingParams.min_tokens
    )
    logit_bias: dict[str, float] | None = doc(
        'JSON object {"token id": bias}: each bias is added to that token\'s logit', default=None, hash=False
    )
    bad_words: tuple[str, ...] = doc(
        "words never generated (repeat the flag for several; tokenized with and without a leading space)", default=()
    )
    allowed_token_ids: tuple[int, ...] | None = doc(
        "sample only among these token ids (repeat the flag, or give a JSON list)", default=None
    )
    json_schema: str | None = doc(
        "structured outputs: every row's output is JSON valid against this schema (a file, or inline JSON)",
        default=None,
    )
    regex: str | None = doc("structured outputs: every row's output matches this regular expression", default=None)
    choice: tuple[str, ...] = doc(
        "structured outputs: every row's output is one of these strings (repeat the flag for each)", default=()
    )
    grammar: str | None = doc(
        "structured outputs: every row's output follows this EBNF (GBNF) grammar file (start rule `root`)",
        default=None,
    )
    include_stop_str_in_output: bool = doc(
        "keep a matched stop string (and a final stop token's text) in generated_text instead of cutting it",
        default=SamplingParams.include_stop_str_in_output,
    )
    skip_special_tokens: bool = doc(
        "leave special tokens out of generated_text", default=SamplingParams.skip_special_tokens
    )
    spaces_between_special_tokens: bool = doc(
        "with --no-skip-special-tokens: off writes adjacent added tokens without the space the decoder puts "
        "between them",
        default=SamplingParams.spaces_between_special_tokens,
    )

    def __post_init__(self) -> None:
        name = logprobs_mode_name(self.logprobs_mode)
        if name is None:
            fail("SamplingConfig", "logprobs_mode", self.logprobs_mode, f"must be raw, processed or {LOGPROBS_MODES}")
        object.__setattr__(self, "logprobs_mode", name)  # one spelling in the manifest and the resume fingerprint
        object.__setattr__(self, "choice", (self.choice,) if isinstance(self.choice, str) else tuple(self.choice))
        object.__setattr__(
            self, "bad_words", (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        )
        object.__setattr__(self, "allowed_token_ids", token_ids_flag(self.allowed_token_ids))
        object.__setattr__(self, "logit_bias", logit_bias_flag(self.logit_bias))
        given = [flag for flag in STRUCTURED_OUTPUT_FLAGS if getattr(self, flag)]
        if len(given) > 1:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
            raise ValueError(f"give at most one of --json-schema, --regex, --choice, --grammar (got {flags})")


@dataclass(frozen=True)
class ChatConfig:
    """How chat (--messages-column) rows are rendered, and the reasoning parser (`workers/chat.py`)."""

    chat_template: str | None = doc(
        "a Jinja chat template file used instead of the tokenizer's (rendered sandboxed by transformers; its "
        "content, not its path, is in the resume fingerprint)",
        default=None,
    )
    chat_template_kwargs: dict[str, Any] | None = doc(
        "variables for the chat template, a JSON object, e.g. '{\"enable_thinking\": false}'", default=None
    )
    add_generation_prompt: bool = doc(
        "end each chat prompt with the assistant turn's opening (vLLM's default)", default=True
    )
    continue_final_message: bool = doc(
        "leave the conversation's final (assistant) message open for the model to continue; needs "
        "--no-add-generation-prompt",
        default=False,
    )
    reasoning_parser: str | None = doc(
        f"split each output into reasoning_text and generated_text (the answer): {', '.join(REASONING_PARSERS)}",
        default=None,
    )

    def __post_init__(self) -> None:
        kwargs = {} if self.chat_template_kwargs is None else self.chat_template_kwargs
        try:
            check_chat_options(kwargs, self.add_generation_prompt, self.continue_final_message)
        except ValueError as error:
            raise ValueError(f"ChatConfig: {error}") from None
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            fail(
                "ChatConfig",
                "reasoning_parser",
                self.reasoning_parser,
                f"must be one of {', '.join(REASONING_PARSERS)}",
            )


@dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding flags (see `workers.SpeculativeConfig`)."""

    speculative: str = doc(f"speculative decoding: {', '.join(SPECULATIVE_METHODS)}", default="none")
    draft_model: str | None = doc("draft model directory or hub id (with --speculative draft)", default=None)
    num_speculative_tokens: int = doc("draft tokens per step at most", default=SpeculativeConfig.num_speculative_tokens)
    speculative_policy: str = doc(
        "adaptive: each step verifies the number of drafts (0 … --num-speculative-tokens) "
        "that this run's measured step times and acceptance say pays best; fixed: always "
        "--num-speculative-tokens",
        default=SpeculativeConfig.policy,
    )
    prompt_lookup_min: int = doc("shortest n-gram to look up (ngram)", default=SpeculativeConfig.prompt_lookup_min)
    prompt_lookup_max: int = doc("longest n-gram to look up (ngram)", default=SpeculativeConfig.prompt_lookup_max)

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            fail(
                "SpeculativeOptions",
                "speculative",
                self.speculative,
                f"must be one of {', '.join(SPECULATIVE_METHODS)}",
            )
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            fail(
                "SpeculativeOptions",
                "speculative_policy",
                self.speculative_policy,
                f"must be one of {', '.join(SPECULATIVE_POLICIES)}",
            )


@dataclass(frozen=True)
class OutputConfig:
    """Where results go."""

    output: str = doc("output directory: local path or a URI pyarrow.fs understands (s3://, gs://)", default="output")
    overwrite: bool = doc("replace an existing output written with a different job config", default=False)


@dataclass(frozen=True)
class GenerateJobConfig:
    """Everything `jobs/generate.py` needs."""

    input: InputConfig
    model: ModelConfig
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        if (self.input.prompt_column is None) == (self.input.messages_column is None):
            raise ValueError("give exactly one of --prompt-column or --messages-column")
        if self.speculative.speculative == "draft" and not self.speculative.draft_model:
            raise ValueError("--speculative draft needs --draft-model")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict (for the manifest)."""
        return dataclasses.asdict(self)
