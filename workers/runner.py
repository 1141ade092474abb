"""The model runner: continuous batching of generation requests over per-request state slots, and scoring."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from workers.budget import TokenBudget
from workers.executors import execution_summary
from workers.memory import DEFAULT_GPU_MEMORY_UTILIZATION, parse_memory_size, plan_memory, runner_budget
from workers.model import HybridModel, load_checkpoint
from workers.model.kernels import native
from workers.model.state import DEFAULT_BLOCK_SIZE
from workers.prefix_sharing import scan_chunk
from workers.requests import GenerationResult, Request, ScoreResult
from workers.sampling import SamplingParams, make_generator
from workers.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, Scheduler
from workers.scorer import Scorer
from workers.spec_decode import SpecStats, SpeculativeConfig, registry
from workers.spec_decode.policy import make_policy
from workers.spec_decode.proposal import Proposer
from workers.spec_decode.registry import ProposerContext
from workers.tokenizer import check_same_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    """Holds one hybrid model on one device and runs batched generation and scoring with it."""

    def __init__(
        self,
        model: HybridModel,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: HybridModel | None = None,
        proposer: Proposer | None = None,
        decode_plan: bool = True,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_memory: int | str | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        cuda_graphs: bool | None = None,
        enable_prefix_caching: bool = True,
    ):
        """Wrap a loaded model; `from_pretrained` is the usual way in.

        `speculative` with method "draft" needs `draft_model` (loaded with the same vocabulary). `proposer`
        replaces the configured proposer (tests force acceptance patterns through it). `decode_plan`: run decode
        steps — plain, speculative verification, draft-model steps — as one native call each where the model allows
        it (see `workers/model/steps/decode_plan.py`; same results as the module-by-module path, which False keeps).
        `max_num_batched_tokens` (vLLM's name): new tokens one forward may take — long prompts are prefilled, and
        long sequences scored, in chunks of at most that many. `max_memory` (CPU; bytes or a size like "8GB";
        default 80 % of the memory available now) and `gpu_memory_utilization` (CUDA; vLLM's fraction of device
        memory) bound weights + activations + KV cache; requests wait for KV room, and one that can never fit
        gets an error result. See `workers/memory.py`. `cuda_graphs`: run decode and verification steps as CUDA
        graphs (`workers/model/steps/cuda_graph.py`; None: on for CUDA devices, off elsewhere; True on CPU runs the
        graph steps' eager form). A capture that fails is logged once and the steps run eagerly. `enable_prefix_caching`
        (vLLM's name): requests sharing a prompt prefix compute it once (`workers/prefix_cache.py`).
        """
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r} is invalid: must be an integer ≥ 1")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise ValueError(f"max_model_len={max_model_len!r} is invalid: must be an integer ≥ 1 or None")
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = TokenBudget(max_num_batched_tokens).max_num_batched_tokens  # validates
        if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} is invalid: must be in (0, 1]")
        max_memory = None if max_memory is None else parse_memory_size(max_memory)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        param = next(model.parameters())
        self.device, self.dtype = param.device, model.embed_tokens.weight.dtype
        self._num_threads = torch.get_num_threads()
        self.prepare_thread()
        self._seed_source = random.Random()  # fresh OS entropy: unseeded requests never repeat across runners
        self.speculative = speculative
        self.draft_model = draft_model
        self._proposer = proposer  # built on first use (`_make_proposer`) unless given; kept for the runner's life
        self.decode_plan = decode_plan
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self._scheduler: Scheduler | None = None  # one for the runner's life (`_engine`)
        self._request_counter = itertools.count()
        self._request_keys: dict[int, Hashable] = {}  # Request.index → the caller's request_id
        self._unclaimed: list[tuple[Hashable, GenerationResult]] = []  # results the next `step` returns first
        self._spec_stats = SpecStats()
        proposer_class = type(proposer) if proposer is not None else speculative and speculative.proposer_class
        mtp = bool(proposer_class and proposer_class.drafts_from_hidden)
        logger.info("decode steps on %s: %s", self.device, execution_summary(model, decode_plan, self.cuda_graphs, mtp))
        if speculative is not None and self.device.type == "cpu" and self.dtype != torch.float32:
            logger.warning(
                "speculative decoding in %s on CPU: a verification's matmuls round differently from decode steps'"
                ", so greedy output may differ from plain decoding in rare tokens; float32 (dtype 'auto' on CPU) is "
                "token-exact",
                str(self.dtype).removeprefix("torch."),
            )
        if mtp and model.mtp is None:
            raise ValueError(
                f"speculative method {speculative.method!r} needs the model loaded with its MTP head "
                "(from_pretrained does)"
            )
        # Kept across generate calls: what it measured (step times, acceptance) stays true for the next shard.
        free = bool(proposer_class and proposer_class.drafts_cost_nothing)
        self._policy = (
            make_policy(speculative.policy, speculative.num_speculative_tokens, free) if speculative else None
        )
        if proposer is None and speculative is not None and speculative.proposer_class.needs_draft_model:
            if draft_model is None:
                raise ValueError(f"speculative method {speculative.method!r} needs a draft model")
            if draft_model.config.vocab_size != self.config.vocab_size:
                raise ValueError(
                    f"draft model vocab_size {draft_model.config.vocab_size} differs from the target's "
                    f"{self.config.vocab_size}: a draft model must share the target's vocabulary"
                )
        k = speculative.num_speculative_tokens if speculative else 0
        self.memory_plan = plan_memory(
            [model] + ([draft_model] if draft_model is not None else []), self.device, self.dtype,
            runner_budget(self.device, max_memory, gpu_memory_utilization), self.max_num_batched_tokens,
            max_num_seqs, k, mtp=mtp,
            prefix_caching=enable_prefix_caching,
        )  # fmt: skip
        self.num_kv_blocks = self.memory_plan.num_kv_blocks
        self._scorer = Scorer(model, max_num_seqs, self.max_num_batched_tokens, scan_chunk(model),
                              share_prefixes=enable_prefix_caching)  # fmt: skip

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        speculative: SpeculativeConfig | None = None,
        linear_backend: str = "auto",
        decode_kernel: str = "auto",
        decode_plan: bool = True,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_memory: int | str | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        cuda_graphs: bool | None = None,
        enable_prefix_caching: bool = True,
        revision: str | None = None,
        quantization: str | None = None,
    ) -> ModelRunner:
        """Load a local HF model directory or hub repo id (safetensors only; a hub repo at `revision`, a branch, tag
        or commit, default main) onto `device` ('cpu', 'cuda', 'auto').

        With `speculative=SpeculativeConfig(method="draft", draft_model=...)` the draft model is loaded too, on the
        same device and dtype (a hub draft at `speculative.draft_revision`), and must have the same vocabulary and
        tokenizer. `linear_backend`: "auto" (the native
        panel kernel on CPU float32, oneDNN without a C compiler, torch elsewhere), "native", "onednn" or "torch"
        (the reference path). `decode_kernel`: how Mamba2 decode steps and the per-token elementwise work run —
        "auto" (native C kernels on CPU float32, else torch), "native", "compile" (torch.compile) or "torch" (the
        reference path). `decode_plan`, `max_num_batched_tokens`, `max_memory`, `gpu_memory_utilization`,
        `cuda_graphs`, `enable_prefix_caching`: see `__init__`. `quantization` (vLLM's name): None, or "int8" (CPU:
        linear weights quantized per output channel at load, for the target and a draft model alike).
        """
        mtp = speculative is not None and speculative.proposer_class.drafts_from_hidden
        checkpoint = load_checkpoint(path, _resolve_device(device), dtype, linear_backend, decode_kernel, mtp, revision,
                                     quantization)  # fmt: skip
        eos = set(checkpoint.config.eos_token_ids)
        generation_eos = checkpoint.generation_config.get("eos_token_id")
        if generation_eos is not None:
            eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        tokenizer = load_tokenizer(checkpoint.directory)
        draft_model = None
        if speculative is not None and speculative.proposer_class.needs_draft_model:
            device_used = checkpoint.model.embed_tokens.weight.device
            draft = load_checkpoint(speculative.draft_model, device_used, dtype, linear_backend, decode_kernel,
                                    revision=speculative.draft_revision, quantization=quantization)  # fmt: skip
            check_same_tokenizer(tokenizer, load_tokenizer(draft.directory), speculative.draft_model)
            draft_model = draft.model
        return cls(checkpoint.model, tokenizer, sorted(eos), max_num_seqs, max_model_len, speculative, draft_model,
                   decode_plan=decode_plan, max_num_batched_tokens=max_num_batched_tokens, max_memory=max_memory,
                   gpu_memory_utilization=gpu_memory_utilization, cuda_graphs=cuda_graphs,
                   enable_prefix_caching=enable_prefix_caching)  # fmt: skip

    def _make_proposer(self) -> Proposer:
        """The runner's proposer, built once through the method registry: its state (KV caches, slots, plans)
        follows the reused workspace."""
        if self._proposer is None:
            config = self.speculative
            assert config is not None
            context = ProposerContext(self.model, config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max, self.draft_model, self.decode_plan)  # fmt: skip
            self._proposer = registry.method(config.method).build(context)
        return self._proposer

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding counters over every request this runner has finished, and how many steps
        verified each number of drafts (`num_steps_by_k`, the adaptive policy's choices)."""
        steps = dict(sorted(self._policy.chosen.items())) if self._policy is not None else {}
        return {**self._spec_stats.as_dict(), "num_steps_by_k": steps}

    # ----------------------------------------------------------------------------------------------- generate
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt; results in input order. A bad prompt fails only its own request.

        A thin loop over the streaming form (`add_request`, `step`): requests other callers added are served in
        the same batches, and their results stay for those callers' `step`s."""
        params = self._per_prompt(prompt_token_ids, sampling)
        keys = [object() for _ in prompt_token_ids]
        for key, prompt, p in zip(keys, prompt_token_ids, params):
            self.add_request(key, prompt, p)
        mine, results, others = set(keys), {}, []
        while len(results) < len(keys):
            for key, result in self.step():
                if key in mine:
                    results[key] = result
                else:
                    others.append((key, result))
        self._unclaimed += others
        return [results[key] for key in keys]

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Queue one prompt (vLLM's `LLMEngine.add_request`); it enters the running batch as soon as a slot and KV
        room are free, beside whatever runs already. Its result comes back from `step` under `request_id`. A bad
        prompt is answered by the next `step` with an error result."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        problem = self._check_prompt(prompt_token_ids, generating=True)
        if problem:
            self._unclaimed.append((request_id, GenerationResult([], "error", problem, None, 0)))
            return
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        generator = make_generator(sampling, self.device, self._seed_source.getrandbits(63))
        index = next(self._request_counter)  # unique over the runner's life (the policy keys its evidence by it)
        self._request_keys[index] = request_id
        prompt = [int(t) for t in prompt_token_ids]
        self._engine().add([Request(index, prompt, sampling, stop_ids, generator, self.max_model_len)])

    def has_unfinished_requests(self) -> bool:
        """Whether any added request has not been returned by `step` yet (vLLM's name)."""
        return bool(self._unclaimed) or (self._scheduler is not None and self._scheduler.has_work())

    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        """One scheduler step (admit, prefill chunks, one decode or verification step); returns the requests that
        finished, as (request_id, result)."""
        done, self._unclaimed = self._unclaimed, []
        scheduler = self._scheduler
        if scheduler is None or not scheduler.has_work():
            return done
        scheduler.step()
        self._check_capture(scheduler)
        for request in scheduler.take_finished():
            self._spec_stats.merge(request.spec)
            done.append((self._request_keys.pop(request.index), request.result(self.tokenizer)))
        return done

    def live_request_ids(self) -> list[Hashable]:
        """The requests the current (or last) step runs, prefilling or generating: those a step that raised can be
        blamed on (the waiting ones never ran)."""
        live = [] if self._scheduler is None else self._scheduler.prefilling + self._scheduler.running
        return [self._request_keys[r.index] for r in live if r.index in self._request_keys]

    def prepare_thread(self) -> None:
        """Set up the calling thread to run this runner's steps: on CPU, denormal floats flushed to zero (they are
        ~100× slower on x86 and change nothing that matters) and the runner's torch threads, both of which are
        per thread (an engine thread starts without them); and, once per process, freed buffers kept mapped for
        reuse (`native.keep_freed_memory_mapped`)."""
        if self.device.type == "cpu":
            torch.set_num_threads(self._num_threads)
            native.flush_denormals()
            native.keep_freed_memory_mapped()

    def reset(self) -> None:
        """Drop every request not returned yet and the engine's slots (after a failed step: the next request starts
        on a fresh engine; what the runner learnt — policy, proposers — stays)."""
        if self._scheduler is not None and self._scheduler.workspace is not None:
            self._scheduler.workspace.release()
            if self._scheduler.proposer is not None:
                self._scheduler.proposer.release()
        self._scheduler = None
        self._request_keys.clear()
        self._unclaimed.clear()

    def scheduler_stats(self) -> dict[str, float]:
        """Steps over the runner's life: `num_steps`, `num_slot_steps` (live requests summed over steps),
        `mean_occupancy` (live requests per step over `max_num_seqs`) and `prefix_cache_hit_tokens`."""
        scheduler = self._scheduler
        steps = scheduler.num_steps if scheduler is not None else 0
        slot_steps = scheduler.num_slot_steps if scheduler is not None else 0
        occupancy = slot_steps / (steps * self.max_num_seqs) if steps else 0.0
        hits = scheduler.num_prefix_hit_tokens if scheduler is not None else 0
        return {"num_steps": steps, "num_slot_steps": slot_steps, "mean_occupancy": occupancy,
                "prefix_cache_hit_tokens": hits}  # fmt: skip

    def _per_prompt(self, prompts: Sequence[Any], sampling: Any) -> list[SamplingParams]:
        if sampling is None:
            sampling = SamplingParams()
        if isinstance(sampling, SamplingParams):
            return [sampling] * len(prompts)
        sampling = list(sampling)
        if len(sampling) != len(prompts) or not all(isinstance(p, SamplingParams) for p in sampling):
            raise ValueError(
                f"sampling must be one SamplingParams or one per prompt ({len(prompts)}), got {len(sampling)} items"
            )
        return sampling

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
            return (f"prompt has {len(prompt)} tokens, max_model_len={self.max_model_len} (prompt + generated "
                    "tokens) leaves no room to generate")  # fmt: skip
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            return f"prompt has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
        return None

    def _engine(self) -> Scheduler:
        """The runner's one scheduler, made on first use: slots, plans and proposer state live as long as it."""
        if self._scheduler is None:
            proposer = self._make_proposer() if self.speculative else None
            k = self.speculative.num_speculative_tokens if self.speculative else 0
            self._scheduler = Scheduler(self.model, [], self.max_num_seqs, self.tokenizer, proposer, k,
                                        self.decode_plan, None, self._policy, self.max_num_batched_tokens,
                                        self.num_kv_blocks, self.cuda_graphs,
                                        self.memory_plan.num_prefix_checkpoints)  # fmt: skip
        return self._scheduler

    def _check_capture(self, scheduler: Scheduler) -> None:
        """Say once when CUDA graph capture failed (the steps then run eagerly)."""
        workspace = scheduler.workspace
        if self.cuda_graphs and workspace is not None and workspace.capture_failure is not None:
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", workspace.capture_failure)
            self.cuda_graphs = False  # once per runner

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
                problem = (f"prompt has {len(seq)} tokens, more than the KV cache holds ({max_positions} positions): "
                           "raise max_memory / gpu_memory_utilization")  # fmt: skip
            if problem:
                results[i] = ScoreResult([], problem.replace("prompt", "sequence", 1))
            else:
                valid.append(i)
        scored = self._scorer.score([list(token_ids[i]) for i in valid], on_forward)
        for i, logprobs in zip(valid, scored):
            results[i] = ScoreResult(logprobs)
        return results  # type: ignore[return-value]
