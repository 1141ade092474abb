"""Per-request bookkeeping of the runner: inputs, outputs, stop conditions, results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.detokenize import decode_text, find_stop
from workers.sampling import PLACEHOLDER_TOKEN_ID, SamplingBatch, SamplingParams
from workers.spec_stats import SpecStats
from workers.structured_outputs import RequestGrammar

REPLACEMENT_CHARACTER = "\ufffd"  # what a decode shows for UTF-8 bytes of a character not complete yet


@dataclass
class GenerationResult:
    """The outcome of one prompt, in input order."""

    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    text: str | None = None
    num_prompt_tokens: int = 0
    num_drafts: int = 0  # speculative verification steps with at least one draft
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache restored (vLLM's name)
    # `SamplingParams.logprobs` = k: one {token_id: logprob} per generated token (the top k in rank order, then the
    # sampled token unless among them), and the sum of the sampled tokens' logprobs (vLLM's names); else None.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    sample_index: int = 0  # which of its prompt's `SamplingParams.n` samples (vLLM's `CompletionOutput.index`)


@dataclass
class ScoreResult:
    """Log-probabilities of one token sequence: token_logprobs[t] = log p(token t+1 | tokens ≤ t)."""

    token_logprobs: list[float]
    error: str | None = None


@dataclass
class Request:
    """A live request: its prompt, what it has generated, and when it must stop."""

    index: int
    prompt: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    max_model_len: int
    output: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    text: str | None = None
    num_computed: int = 0  # prompt tokens already in the state (chunked prefill)
    num_reserved: int = 0  # KV positions reserved at admission
    num_reserved_blocks: int = 0  # KV blocks of its own it still has reserved (shared cached blocks are not)
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of computed
    prefill_stops: list[int] = field(default_factory=list)  # positions where its prefill stops to checkpoint
    prefix_path: list[Any] = field(default_factory=list)  # its prompt blocks as prefix-cache entries (acquired)
    error: str | None = None
    decoded_chars: int = 0  # length of the output's settled text (no trailing U+FFFD) at the previous check
    spec: SpecStats = field(default_factory=SpecStats)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # one per generated token, when asked
    cumulative_logprob: float = 0.0
    sample_index: int = 0  # which of its prompt's n samples (`workers/samples.py`)
    group: Any | None = None  # the `SampleGroup` of a prompt with n > 1 samples (None: n = 1)
    grammar: RequestGrammar | None = None  # its structured-outputs matcher (`workers/structured_outputs.py`)
    options: Any | None = None  # its logits options' state (`workers.logits_processors.RowOptions`), made on first use

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.output)

    def next_prefill_stop(self) -> int:
        """Where the next prefill chunk ends at the latest: a checkpoint position ahead, else the prompt's end."""
        return next((stop for stop in self.prefill_stops if stop > self.num_computed), len(self.prompt))

    @property
    def last_token(self) -> int:
        """The newest token, the next input of the model."""
        return self.output[-1] if self.output else self.prompt[-1]

    def token_at(self, position: int) -> int:
        """The token at `position` of prompt + output."""
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output[position - n]

    def append(self, token: int, tokenizer: Any | None) -> bool:
        """Add one generated token; return True when the request has finished (and set its reason)."""
        self.output.append(token)
        complete = self.grammar is not None and self.grammar.advance(token)  # the grammar follows every token
        if token in self.stop_token_ids or complete:
            self.finish_reason = "stop"
        elif self.params.stop and tokenizer is not None and self._hit_stop_string(tokenizer):
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def append_verified(self, row: list[int], num_drafts: int, tokenizer: Any | None) -> None:
        """Add a verification's valid tokens (`row`: the rejection sampler's row, -1 placeholders after them),
        stopping exactly where plain decoding would (eos, stop string, max_tokens), and record the drafts: only
        accepted drafts that were kept count (a stop inside the accepted run drops the rest)."""
        tokens = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
        num_kept = 0
        for token in tokens:
            num_kept += 1
            if self.append(token, tokenizer):
                break
        self.spec.record(num_drafts, min(len(tokens) - 1, num_kept))

    def record_logprobs(self, entry: dict[int, float], token_logprob: float) -> None:
        """The logprobs of the newest generated token: its position's entry and the token's own logprob."""
        self.logprobs.append(entry)
        self.cumulative_logprob += token_logprob

    def _hit_stop_string(self, tokenizer: Any) -> bool:
        text = decode_text(tokenizer, self.output, self.params)
        # Only a stop string that ends after the previously settled text can be new (one decode per token). A
        # character whose UTF-8 bytes span tokens decodes as trailing U+FFFD until its last byte arrives, so the
        # settled text is the decode without its trailing replacement characters.
        tail, self.decoded_chars = self.decoded_chars, len(text.rstrip(REPLACEMENT_CHARACTER))
        if len(self.output) <= self.params.min_tokens:  # vLLM: no stop string before min_tokens (text kept settled)
            return False
        end = find_stop(text, self.params.stop, tail, self.params.include_stop_str_in_output)
        if end is not None:
            self.text = text[:end]
        return end is not None

    def result(self, tokenizer: Any | None) -> GenerationResult:
        """Freeze into a `GenerationResult`; the text leaves out a final stop token (unless
        `include_stop_str_in_output`, as vLLM) and, by default, special tokens."""
        text = self.text
        if text is None and tokenizer is not None:
            visible = self.output
            if visible and visible[-1] in self.stop_token_ids and not self.params.include_stop_str_in_output:
                visible = visible[:-1]
            text = decode_text(tokenizer, visible, self.params)
        asked = self.params.logprobs is not None
        return GenerationResult(
            list(self.output),
            self.finish_reason or "length",
            self.error,
            text,
            len(self.prompt),
            self.spec.num_drafts,
            self.spec.num_draft_tokens,
            self.spec.num_accepted_draft_tokens,
            self.num_cached_tokens,
            list(self.logprobs) if asked else None,
            self.cumulative_logprob if asked else None,
            sample_index=self.sample_index,
        )


def sampling_batch(requests: list[Request], masks: torch.Tensor | None = None) -> SamplingBatch:
    """The requests' sampling state, row by row (`masks`: the step's grammar masks, if any row has a constraint)."""
    return SamplingBatch([r.params for r in requests], [r.generator for r in requests], masks)
