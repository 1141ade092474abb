"""The model runner: continuous batching of generation requests over per-request state slots, and scoring."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from workers.model import ForwardBatch, HybridModel, StatePool, load_checkpoint
from workers.requests import GenerationResult, Request, ScoreResult
from workers.sampling import SamplingParams, make_generator, sample


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _load_tokenizer(directory: Path) -> Any | None:
    """The model directory's tokenizer (no remote code), or None when it ships none."""
    if not any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)


class ModelRunner:
    """Holds one hybrid model on one device and runs batched generation and scoring with it."""

    def __init__(
        self,
        model: HybridModel,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
    ):
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r} is invalid: must be an integer ≥ 1")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise ValueError(f"max_model_len={max_model_len!r} is invalid: must be an integer ≥ 1 or None")
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        param = next(model.parameters())
        self.device, self.dtype = param.device, model.embed_tokens.weight.dtype
        self._seed_source = random.Random(0)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
    ) -> ModelRunner:
        """Load a local HF model directory or hub repo id (safetensors only) onto `device` ('cpu', 'cuda', 'auto')."""
        checkpoint = load_checkpoint(path, _resolve_device(device), dtype)
        eos = set(checkpoint.config.eos_token_ids)
        generation_eos = checkpoint.generation_config.get("eos_token_id")
        if generation_eos is not None:
            eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        tokenizer = _load_tokenizer(checkpoint.directory)
        return cls(checkpoint.model, tokenizer, sorted(eos), max_num_seqs, max_model_len)

    # ----------------------------------------------------------------------------------------------- generate
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Generate for every prompt; results in input order. A bad prompt fails only its own request."""
        params = self._per_prompt(prompt_token_ids, sampling)
        results: list[GenerationResult | None] = [None] * len(prompt_token_ids)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompt_token_ids, params)):
            problem = self._check_prompt(prompt)
            if problem:
                results[i] = GenerationResult([], "error", problem, None, 0)
                continue
            stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
            generator = make_generator(p, self.device, self._seed_source.getrandbits(63))
            requests.append(Request(i, [int(t) for t in prompt], p, stop_ids, generator, self.max_model_len))
        for request in self._run(requests):
            results[request.index] = request.result(self.tokenizer)
        return results  # type: ignore[return-value]

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

    def _check_prompt(self, prompt: Any) -> str | None:
        """Why this prompt cannot run, or None."""
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            return "prompt must be a list of token ids (ints)"
        if len(prompt) == 0:
            return "prompt is empty"
        if len(prompt) > self.max_model_len:
            return f"prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}"
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            return f"prompt has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
        return None

    @torch.inference_mode()
    def _run(self, requests: list[Request]) -> list[Request]:
        """Continuous batching: fill free slots with prefills, decode all live requests together each step."""
        if not requests:
            return []
        capacity = min(self.max_model_len, max(len(r.prompt) + r.params.max_tokens for r in requests))
        num_slots = min(self.max_num_seqs, len(requests))
        pool = StatePool(self.config, num_slots, capacity, self.device, self.dtype)
        free_slots = list(range(num_slots - 1, -1, -1))
        waiting, running, done = deque(requests), [], []
        while waiting or running:
            admitted = []
            while waiting and free_slots:
                request = waiting.popleft()
                request.slot = free_slots.pop()
                admitted.append(request)
            if admitted:
                self._prefill(admitted, pool)
                running += admitted
            elif running:
                self._decode(running, pool)
            still_running = []
            for request in running:
                if request.finish_reason is None:
                    still_running.append(request)
                else:
                    free_slots.append(request.slot)
                    done.append(request)
            running = still_running
        return done

    def _prefill(self, requests: list[Request], pool: StatePool) -> None:
        """Run the prompts of newly admitted requests from zero state and sample their first tokens."""
        lengths = [len(r.prompt) for r in requests]
        input_ids = torch.zeros(len(requests), max(lengths), dtype=torch.long)
        for row, r in enumerate(requests):
            input_ids[row, : len(r.prompt)] = torch.tensor(r.prompt)
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        num_tokens = torch.tensor(lengths, device=self.device)
        batch = ForwardBatch(slots, torch.zeros_like(num_tokens), num_tokens)
        hidden, states = self.model(input_ids.to(self.device), batch, pool.zeros(len(requests)), pool.kv_caches())
        pool.write(slots, states)
        last = hidden[torch.arange(len(requests), device=self.device), num_tokens - 1]
        self._sample_and_append(requests, self.model.logits(last))

    def _decode(self, requests: list[Request], pool: StatePool) -> None:
        """One token for every live request, from its slot's state."""
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        input_ids = torch.tensor([[r.last_token] for r in requests], device=self.device)
        cache_lens = torch.tensor([r.num_tokens - 1 for r in requests], device=self.device)
        batch = ForwardBatch(slots, cache_lens, torch.ones_like(cache_lens))
        hidden, states = self.model(input_ids, batch, pool.read(slots), pool.kv_caches())
        pool.write(slots, states)
        self._sample_and_append(requests, self.model.logits(hidden[:, 0]))

    def _sample_and_append(self, requests: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        for request, token in zip(requests, tokens):
            request.append(token, self.tokenizer)

    # -------------------------------------------------------------------------------------------------- score
    @torch.inference_mode()
    def score(self, token_ids: Sequence[Sequence[int]]) -> list[ScoreResult]:
        """Per sequence, log p(token t+1 | tokens ≤ t) for every t; batched prefill, no generation."""
        results: list[ScoreResult | None] = [None] * len(token_ids)
        valid = []
        for i, seq in enumerate(token_ids):
            problem = self._check_prompt(seq)
            if problem:
                results[i] = ScoreResult([], problem.replace("prompt", "sequence", 1))
            else:
                valid.append(i)
        valid.sort(key=lambda i: len(token_ids[i]))  # similar lengths together: little padding
        for start in range(0, len(valid), self.max_num_seqs):
            group = valid[start : start + self.max_num_seqs]
            for i, logprobs in zip(group, self._score_group([list(token_ids[i]) for i in group])):
                results[i] = ScoreResult(logprobs)
        return results  # type: ignore[return-value]

    def _score_group(self, sequences: list[list[int]]) -> list[list[float]]:
        lengths = [len(s) for s in sequences]
        input_ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = torch.tensor(seq)
        input_ids = input_ids.to(self.device)
        pool = StatePool(self.config, len(sequences), max(lengths), self.device, self.dtype)
        num_tokens = torch.tensor(lengths, device=self.device)
        batch = ForwardBatch(torch.arange(len(sequences), device=self.device), torch.zeros_like(num_tokens), num_tokens)
        hidden, _ = self.model(input_ids, batch, pool.zeros(len(sequences)), pool.kv_caches())
        out = []
        for row, length in enumerate(lengths):
            logprobs = self.model.logits(hidden[row, : length - 1]).log_softmax(-1)
            out.append(logprobs.gather(-1, input_ids[row, 1:length, None]).squeeze(-1).tolist())
        return out
