"""The streaming request API of a runner (vLLM's `LLMEngine` calls): requests are added at any time, each `step`
runs one scheduler step and returns the requests that finished; `generate` is a loop over them."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from workers.executors import tensor_parallel_size
from workers.logits_processors import admit_options
from workers.requests import GenerationResult, Request
from workers.samples import group_requests, sample_generators
from workers.sampling import SamplingParams
from workers.scheduler import Scheduler
from workers.spec_decode import registry
from workers.spec_decode.proposal import Proposer
from workers.spec_decode.registry import ProposerContext
from workers.structured_outputs import GrammarCompilerCache, RequestGrammar


class RequestEngine:
    """The request side of `ModelRunner`: its requests, its one scheduler and their results. Holds no model of its
    own; `ModelRunner.__init__` sets the state it reads (model, config, tokenizer, proposer, policy, counters)."""

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding counters over every request this runner has finished, and how many steps
        verified each number of drafts (`num_steps_by_k`, the adaptive policy's choices)."""
        steps = dict(sorted(self._policy.chosen.items())) if self._policy is not None else {}
        return {**self._spec_stats.as_dict(), "num_steps_by_k": steps}

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt; results in input order, prompt-major: a prompt with `SamplingParams.n` = n
        gives n results in sample order (`sample_index` 0 … n-1). A bad prompt fails only its own request.

        A thin loop over the streaming form (`add_request`, `step`): requests other callers added are served in
        the same batches, and their results stay for those callers' `step`s."""
        params = self._per_prompt(prompt_token_ids, sampling)
        keys = [object() for _ in prompt_token_ids]
        for key, prompt, p in zip(keys, prompt_token_ids, params):
            self.add_request(key, prompt, p)
        mine, results, others = set(keys), {}, []
        while len(results) < sum(p.n for p in params):
            for key, result in self.step():
                if key in mine:
                    results[key, result.sample_index] = result
                else:
                    others.append((key, result))
        self._unclaimed += others
        return [results[key, j] for key, p in zip(keys, params) for j in range(p.n)]

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Queue one prompt (vLLM's `LLMEngine.add_request`); it enters the running batch as soon as a slot and KV
        room are free, beside whatever runs already. Its result comes back from `step` under `request_id`; with
        `sampling.n` > 1, its n results come back one by one as each sample finishes, all under `request_id`, told
        apart by `GenerationResult.sample_index` (vLLM's `CompletionOutput.index`). A bad prompt is answered by the
        next `step` with an error result (one per sample)."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        problem = self._check_prompt(prompt_token_ids, generating=True)
        if problem:
            errors = [GenerationResult([], "error", problem, None, 0, sample_index=j) for j in range(sampling.n)]
            self._unclaimed += [(request_id, error) for error in errors]
            return
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        grammars, problem = self._request_grammars(sampling, stop_ids)
        options, option_problem = admit_options(sampling, self.tokenizer, self.config.vocab_size)
        problem = problem or option_problem or None
        if problem:
            errors = [
                GenerationResult([], "error", problem, None, len(prompt_token_ids), sample_index=j)
                for j in range(sampling.n)
            ]
            self._unclaimed += [(request_id, error) for error in errors]
            return
        prompt = [int(t) for t in prompt_token_ids]
        samples = []
        for j, generator in enumerate(sample_generators(sampling, self.device, self._seed_source)):
            index = next(self._request_counter)  # unique over the runner's life (the policy keys its evidence by it)
            self._request_keys[index] = request_id
            request = Request(
                index, prompt, sampling, stop_ids, generator, self.max_model_len, sample_index=j, grammar=grammars[j]
            )
            request.options = None if options is None else replace(options)  # each sample counts its own tokens
            samples.append(request)
        # Followers build the same requests (no grammar: the leader samples and masks) and admit them alike.
        specs = [(r.index, r.prompt, r.params, r.stop_token_ids, r.max_model_len, r.sample_index) for r in samples]
        self._lockstep.publish("add", specs)
        self._engine().add([group_requests(samples)])

    def _request_grammars(
        self, sampling: SamplingParams, stop_ids: frozenset[int]
    ) -> tuple[list[RequestGrammar | None], str | None]:
        """(each sample's grammar state, None), or ([], why its constraint cannot run). Constraints compile over the
        runner's tokenizer, once per distinct constraint (`GrammarCompilerCache`); each sample has its own matcher."""
        if sampling.structured_outputs is None:
            return [None] * sampling.n, None
        if self.tokenizer is None:
            return [], "structured_outputs needs the runner's tokenizer (load the model with from_pretrained)"
        if self._grammars is None:
            self._grammars = GrammarCompilerCache(self.tokenizer, self.config.vocab_size)
        try:
            return [
                self._grammars.request_grammar(sampling.structured_outputs, stop_ids) for _ in range(sampling.n)
            ], None
        except ValueError as error:
            return [], str(error)

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
        self._lockstep.publish("step")
        try:
            scheduler.step()
        except BaseException as error:
            self._lockstep.abort(error)  # followers drop the step they replay; `reset` follows
            raise
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

    def reset(self) -> None:
        """Drop every request not returned yet and the engine's slots (after a failed step: the next request starts
        on a fresh engine; what the runner learnt — policy, proposers — stays)."""
        self._lockstep.publish("reset")
        if self._scheduler is not None and self._scheduler.workspace is not None:
            self._scheduler.workspace.release()
            if self._scheduler.proposer is not None:
                self._scheduler.proposer.release()
        self._scheduler = None
        self._request_keys.clear()
        self._unclaimed.clear()

    def scheduler_stats(self) -> dict[str, float]:
        """Steps over the runner's life: `num_steps`, `num_slot_steps` (live requests summed over steps),
        `mean_occupancy` (live requests per step over `max_num_seqs`), `prefix_cache_hit_tokens` and
        `prefill_tokens` (prompt tokens computed: neither restored from the cache nor forked)."""
        scheduler = self._scheduler
        steps = scheduler.num_steps if scheduler is not None else 0
        slot_steps = scheduler.num_slot_steps if scheduler is not None else 0
        occupancy = slot_steps / (steps * self.max_num_seqs) if steps else 0.0
        hits = scheduler.num_prefix_hit_tokens if scheduler is not None else 0
        prefilled = scheduler.num_prefill_tokens if scheduler is not None else 0
        return {
            "num_steps": steps,
            "num_slot_steps": slot_steps,
            "mean_occupancy": occupancy,
            "prefix_cache_hit_tokens": hits,
            "prefill_tokens": prefilled,
        }

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

    def _make_proposer(self) -> Proposer:
        """The runner's proposer, built once through the method registry: its state (KV caches, slots, plans)
        follows the reused workspace."""
        if self._proposer is None:
            config = self.speculative
            assert config is not None
            context = ProposerContext(
                self.model,
                config.num_speculative_tokens,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                self.draft_model,
                self.decode_plan and tensor_parallel_size(self.model) == 1,  # a split model's MTP runs unplanned
            )
            self._proposer = registry.method(config.method).build(context)
        return self._proposer

    def _engine(self) -> Scheduler:
        """The runner's one scheduler, made on first use: slots, plans and proposer state live as long as it."""
        if self._scheduler is None:
            proposer = self._make_proposer() if self.speculative else None
            self._scheduler = Scheduler(
                self.model,
                self.engine_config,
                (),
                proposer,
                self._policy,
                self.tokenizer,
                self.num_kv_blocks,
                self.memory_plan.num_prefix_checkpoints,
                lockstep=self._lockstep,
            )
        return self._scheduler
