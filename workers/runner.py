"""The model runner: continuous batching of generation requests over per-request state slots, and scoring."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from workers.config import EngineConfig
from workers.distributed.follower import LoadSpec
from workers.distributed.launch import RankGroup, RankOwner
from workers.distributed.lockstep import SINGLE_LOCKSTEP, Lockstep, ReplayProposer
from workers.engine import RequestEngine
from workers.execution_summary import execution_summary
from workers.memory import agree_memory_plan, plan_memory, runner_budget
from workers.model import HybridModel, load_checkpoint
from workers.model.distributed import TensorParallel
from workers.model.kernels import heap, native
from workers.model.loader import LoadedCheckpoint
from workers.model.state import DEFAULT_BLOCK_SIZE
from workers.prefix_sharing import scan_chunk
from workers.requests import GenerationResult, ScoreResult
from workers.scheduler import Scheduler
from workers.scorer import Scorer
from workers.spec_decode import SpecStats
from workers.spec_decode.policy import make_policy
from workers.spec_decode.proposal import Proposer
from workers.structured_outputs import GrammarCompilerCache
from workers.tokenizer import check_same_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _load_target(path: str, config: EngineConfig, lockstep: Lockstep, mtp: bool) -> LoadedCheckpoint:
    """This rank's shard of the target (the whole model at one rank, or in the tests' replicated mode); rank r of
    a CUDA group on `cuda:r`."""
    load, parallel = config.load, config.parallel
    device = _resolve_device(load.device)
    if lockstep.size > 1 and device.type == "cuda":
        device = torch.device("cuda", lockstep.rank)
    args = (path, device, load.dtype, load.linear_backend, load.decode_kernel, mtp, load.revision, load.quantization)
    if lockstep.size == 1 or parallel.replicate_model:
        return load_checkpoint(*args)
    tp = TensorParallel(lockstep.rank, lockstep.size, parallel.enable_expert_parallel, lockstep.group)
    return load_checkpoint(*args, tp=tp)


def _eos_token_ids(checkpoint: LoadedCheckpoint) -> list[int]:
    """The end-of-sequence ids of the config and of generation_config.json."""
    eos = set(checkpoint.config.eos_token_ids)
    generation_eos = checkpoint.generation_config.get("eos_token_id")
    if generation_eos is not None:
        eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(eos)


def _load_draft(config: EngineConfig, tokenizer: Any, target: HybridModel) -> HybridModel:
    """The speculative config's draft model, whole, beside the target (same device, dtype and tokenizer)."""
    load, speculative = config.load, config.speculative
    draft = load_checkpoint(
        speculative.draft_model,
        target.embed_tokens.weight.device,
        load.dtype,
        load.linear_backend,
        load.decode_kernel,
        revision=speculative.draft_revision,
        quantization=load.quantization,
    )
    check_same_tokenizer(tokenizer, load_tokenizer(draft.directory), speculative.draft_model)
    return draft.model


class ModelRunner(RequestEngine, RankOwner):
    """Holds one hybrid model on one device and runs batched generation and scoring with it."""

    def __init__(
        self,
        model: HybridModel,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        config: EngineConfig | None = None,
        draft_model: HybridModel | None = None,
        proposer: Proposer | None = None,
        lockstep: Lockstep | None = None,
        **options: Any,
    ):
        """Wrap a loaded model; `from_pretrained` is the usual way in.

        `config` (default `EngineConfig()`) with `options` replacing fields of its sections by name, e.g.
        `max_num_seqs=8, decode_plan=False, speculative=SpeculativeConfig("ngram")` (`workers/config.py` says what
        each means). A speculative method whose proposer `needs_draft_model` needs `draft_model` (loaded with the same
        vocabulary). `proposer` replaces the configured proposer (tests force acceptance patterns through it).
        Memory: weights + activations + KV cache stay within `max_memory` (CPU) or `gpu_memory_utilization` (CUDA);
        requests wait for KV room, and one that can never fit gets an error result (`workers/memory.py`). A CUDA
        graph capture that fails is logged once and the steps run eagerly. `lockstep`: this rank's place in a
        tensor-parallel group (`from_pretrained` starts the group; a model built here holds one rank).
        """
        config = (config or EngineConfig()).replace(**options)
        size = config.parallel.tensor_parallel_size
        if lockstep is None and size > 1:
            raise ValueError(
                f"tensor_parallel_size={size} needs the rank processes ModelRunner.from_pretrained starts; "
                "a ModelRunner built from a model holds one rank"
            )
        self._lockstep = lockstep or SINGLE_LOCKSTEP
        self.model, self.config, self.tokenizer = model, model.config, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.scheduler.max_model_len or self.config.max_position_embeddings
        self.device, self.dtype = next(model.parameters()).device, model.embed_tokens.weight.dtype
        cuda_graphs = config.execution.cuda_graphs
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.engine_config = config.replace(cuda_graphs=self.cuda_graphs)
        self._num_threads = torch.get_num_threads()
        self.prepare_thread()
        self._seed_source = random.Random()  # fresh OS entropy: unseeded requests never repeat across runners
        self.speculative, self.draft_model = config.speculative, draft_model
        self._proposer = proposer  # built on first use (`_make_proposer`) unless given; kept for the runner's life
        self._scheduler: Scheduler | None = None  # one for the runner's life (`_engine`)
        self._request_counter = itertools.count()
        self._request_keys: dict[int, Hashable] = {}  # Request.index → the caller's request_id
        self._unclaimed: list[tuple[Hashable, GenerationResult]] = []  # results the next `step` returns first
        self._spec_stats = SpecStats()
        self._grammars: GrammarCompilerCache | None = None  # structured outputs' compiler, made on first use
        proposer_class = (
            type(proposer) if proposer is not None else config.speculative and config.speculative.proposer_class
        )
        self._check_speculative(proposer_class)
        # Kept across generate calls: what it measured (step times, acceptance) stays true for the next shard.
        self._policy = None
        if config.speculative is not None:
            free = proposer_class.drafts_cost_nothing
            self._policy = make_policy(config.speculative.policy, config.num_speculative_tokens, free)
        self._plan_memory()

    def _plan_memory(self) -> None:
        """Out of the memory budget: weights, state slots, one forward's activations, then KV blocks (and the
        scorer, which pages over the same budget)."""
        config, model = self.engine_config, self.model
        models = [model] + ([self.draft_model] if self.draft_model is not None else [])
        cache, scheduler = config.cache, config.scheduler
        budget = runner_budget(self.device, cache.max_memory_bytes, cache.gpu_memory_utilization)
        self.memory_plan = plan_memory(
            models,
            self.device,
            self.dtype,
            budget,
            scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            config.num_speculative_tokens,
            mtp=self._drafts_from_hidden,
            prefix_caching=cache.enable_prefix_caching,
        )
        self.memory_plan = agree_memory_plan(self.memory_plan, self._lockstep.group)
        self.num_kv_blocks = self.memory_plan.num_kv_blocks
        self._scorer = Scorer(
            model,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            scan_chunk(model),
            share_prefixes=cache.enable_prefix_caching,
        )

    def _check_speculative(self, proposer_class: type[Proposer] | None) -> None:
        """Say how steps run (one log line), and refuse a speculative method the loaded models cannot serve."""
        self._drafts_from_hidden = bool(proposer_class and proposer_class.drafts_from_hidden)
        decode_plan, speculative = self.engine_config.execution.decode_plan, self.speculative
        summary = execution_summary(self.model, decode_plan, self.cuda_graphs, self._drafts_from_hidden)
        logger.info("decode steps on %s: %s", self.device, summary)
        if speculative is not None and self.device.type == "cpu" and self.dtype != torch.float32:
            logger.warning(
                "speculative decoding in %s on CPU: a verification's matmuls round differently from decode steps'"
                ", so greedy output may differ from plain decoding in rare tokens; float32 (dtype 'auto' on CPU) is "
                "token-exact",
                str(self.dtype).removeprefix("torch."),
            )
        if self._drafts_from_hidden and self.model.mtp is None:
            raise ValueError(
                f"speculative method {speculative.method!r} needs the model loaded with its MTP head "
                "(from_pretrained does)"
            )
        if self._proposer is None and proposer_class is not None and proposer_class.needs_draft_model:
            draft = self.draft_model
            if draft is None:
                raise ValueError(f"speculative method {speculative.method!r} needs a draft model")
            if draft.config.vocab_size != self.config.vocab_size:
                raise ValueError(
                    f"draft model vocab_size {draft.config.vocab_size} differs from the target's "
                    f"{self.config.vocab_size}: a draft model must share the target's vocabulary"
                )

    @property
    def max_num_seqs(self) -> int:
        """Requests decoded together at most."""
        return self.engine_config.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """New tokens one forward may take at most."""
        return self.engine_config.scheduler.max_num_batched_tokens

    @property
    def decode_plan(self) -> bool:
        """Whether decode steps may run as decode plans."""
        return self.engine_config.execution.decode_plan

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None, **options: Any) -> ModelRunner:
        """Load a local HF model directory or hub repo id (safetensors only) and wrap it: `config` (default
        `EngineConfig()`) with `options` replacing fields of its sections by name, e.g. `device="auto"`,
        `dtype="auto"`, `max_num_seqs=8`, `revision="main"`, `quantization="int8"`, `speculative=...`.

        The load options (`LoadConfig`): `device` ('cpu', 'cuda', 'auto'), `dtype`, `revision` (a hub repo's
        branch, tag or commit, default main), `quantization` (vLLM's name: None, or "int8", "int8_weight_only",
        "w8a8" on CPU, for the target and a draft model alike; "fp8": a block-wise FP8 checkpoint's linears kept in FP8), `linear_backend` ("auto": the native panel kernel
        on CPU float32, oneDNN without a C compiler, torch elsewhere; "native", "onednn" or "torch", the reference)
        and `decode_kernel` ("auto": native C kernels on CPU float32, else torch; "native", "compile", "triton" or
        "torch", the reference). A speculative method whose proposer `needs_draft_model` loads
        `speculative.draft_model` too (a hub draft at `speculative.draft_revision`), on the same device and dtype,
        with the same vocabulary and tokenizer; one whose proposer `drafts_from_hidden` loads the MTP head.

        `tensor_parallel_size` = T > 1 splits the model over T ranks: this process is rank 0 and spawns ranks 1 … T-1
        (rank r on `cuda:r`; `workers/distributed/`), which `close()` stops; `enable_expert_parallel` divides MoE
        experts among them; a draft model loads whole on rank 0.
        """
        config = (config or EngineConfig()).replace(**options)
        size = config.parallel.tensor_parallel_size
        if size == 1:
            return cls._load_rank(path, config, SINGLE_LOCKSTEP)
        device = _resolve_device(config.load.device).type
        threads = config.parallel.num_threads or max(1, torch.get_num_threads() // size)
        group = RankGroup.start(LoadSpec(path, config, device, threads), cls)
        try:
            runner = cls._load_rank(path, config, group.lockstep)
        except BaseException:
            group.close()
            raise
        runner._rank_group = group
        return runner

    @classmethod
    def _load_rank(cls, path: str, config: EngineConfig, lockstep: Lockstep) -> ModelRunner:
        """Load this rank's shard and wrap it; rank 0 also loads the tokenizer and a draft model (unsharded, on
        rank 0 alone: its drafts reach the followers as decisions)."""
        speculative = config.speculative
        mtp = speculative is not None and speculative.proposer_class.drafts_from_hidden
        checkpoint = _load_target(path, config, lockstep, mtp)
        needs_draft = speculative is not None and speculative.proposer_class.needs_draft_model
        if lockstep.follows:
            proposer = ReplayProposer() if needs_draft else None
            return cls(checkpoint.model, None, (), config, None, proposer, lockstep=lockstep)
        tokenizer = load_tokenizer(checkpoint.directory)
        draft_model = _load_draft(config, tokenizer, checkpoint.model) if needs_draft else None
        return cls(checkpoint.model, tokenizer, _eos_token_ids(checkpoint), config, draft_model, lockstep=lockstep)

    def prepare_thread(self) -> None:
        """Set up the calling thread to run this runner's steps: on CPU, denormal floats flushed to zero (they are
        ~100× slower on x86 and change nothing that matters) and the runner's torch threads, both of which are
        per thread (an engine thread starts without them); and, once per process, freed buffers kept mapped for
        reuse (`heap.keep_freed_memory_mapped`)."""
        if self.device.type == "cpu":
            torch.set_num_threads(self._num_threads)
            native.flush_denormals()
            heap.keep_freed_memory_mapped()

    def _check_prompt(self, prompt: Any, generating: bool = False) -> str | None:
        """Why this prompt cannot run, or None. `generating`: it must leave room for one generated token, since
        max_model_len bounds prompt + generated tokens."""
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            return "prompt must be a list of token ids (ints)"
        if len(prompt) == 0:
            return "prompt is empty"
        if len(prompt) > self.max_model_len:
            return f"prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}"
        if generating and len(prompt) == self.max_model_len:
            return (
                f"prompt has {len(prompt)} tokens, max_model_len={self.max_model_len} (prompt + generated "
                "tokens) leaves no room to generate"
            )
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            return f"prompt has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
        return None

    def _check_capture(self, scheduler: Scheduler) -> None:
        """Say once when CUDA graph capture failed (the steps then run eagerly)."""
        workspace = scheduler.workspace
        if self.cuda_graphs and workspace is not None and workspace.capture_failure is not None:
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", workspace.capture_failure)
            self.cuda_graphs = False  # once per runner; a later scheduler runs eagerly from the start
            self.engine_config = self.engine_config.replace(cuda_graphs=False)

    # -------------------------------------------------------------------------------------------------- score
    def score(
        self, token_ids: Sequence[Sequence[int]], on_forward: Callable[[], None] | None = None
    ) -> list[ScoreResult]:
        """Per sequence, log p(token t+1 | tokens ≤ t) for every t. Short sequences share padded forwards of at most
        `max_num_batched_tokens` tokens; a longer one runs alone in chunks of that many, continuing its recurrent
        states and KV cache (the same log-probs as one forward over it, in bounded memory). With prefix caching,
        sequences sharing a long prefix compute it once (`workers/scorer.py`). `on_forward` is called after each."""
        results: list[ScoreResult | None] = [None] * len(token_ids)
        valid = []
        max_positions = (self.num_kv_blocks - 1) * DEFAULT_BLOCK_SIZE
        for i, seq in enumerate(token_ids):
            problem = self._check_prompt(seq)
            if problem is None and len(seq) > max_positions:
                problem = (
                    f"prompt has {len(seq)} tokens, more than the KV cache holds ({max_positions} positions): "
                    "raise max_memory / gpu_memory_utilization"
                )
            if problem:
                results[i] = ScoreResult([], problem.replace("prompt", "sequence", 1))
            else:
                valid.append(i)
        sequences = [list(token_ids[i]) for i in valid]
        self._lockstep.publish("score", sequences)  # followers run the same forwards (their collectives)
        scored = self._scorer.score(sequences, on_forward)
        for i, logprobs in zip(valid, scored):
            results[i] = ScoreResult(logprobs)
        return results  # type: ignore[return-value]
