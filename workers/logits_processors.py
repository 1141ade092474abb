"""The logits options that read a request's tokens or edit its logits (vLLM's logits processors and penalties):
`allowed_token_ids`, `bad_words`, `min_tokens`, `logit_bias`, then the repetition, frequency and presence
penalties — vLLM's order (`min_p` is part of `workers.sampling.sampling_logits`, after temperature).

Under speculative decoding every verification position j is processed with the row's drafts 0 … j − 1 counted as
if they had been generated (penalty counts, the output length `min_tokens` reads, the tokens a bad word's prefix
matches): the target distribution there is exactly the one plain decoding would have at that position had the drafts
been sampled, so greedy acceptance compares drafts with the processed argmax and rejection sampling keeps the
processed distribution. Draft distributions q stay unprocessed: rejection sampling returns exactly p for any q the
drafts are drawn from (Leviathan et al. 2023, Theorem 1), so a q without the options costs acceptance, never
exactness. Every executor returns logits and the target's choice is made from them in Python
(`workers/step_apply.py`), so no fused path can skip an option.

Per-request state (`RowOptions`) is incremental: the output token counts are a [v] row kept between steps and
caught up with the tokens appended since, all rows at once (one stack, one scatter-add per step); rows without an
option are never touched (their logits keep their bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.sampling import PLACEHOLDER_TOKEN_ID, SamplingBatch, SamplingParams

__all__ = ["RowOptions", "StepOptions", "admit_options", "apply_options", "step_options"]


@dataclass
class RowOptions:
    """One request's option state: its bad words as token ids, and its output token counts so far."""

    bad_words: tuple[tuple[int, ...], ...] = ()
    counts: torch.Tensor | None = None  # [v] float32 (exact integers): counts of output[: num_counted]
    num_counted: int = 0
    static: torch.Tensor | None = None  # [v] float32: logit_bias added, -inf outside allowed_token_ids
    prompt_seen: torch.Tensor | None = None  # [v] float32: 1 at the prompt's tokens (repetition penalty)


def admit_options(params: SamplingParams, tokenizer: Any | None, vocab_size: int) -> tuple[RowOptions | None, str]:
    """(a request's option state, "") or (None, why the request cannot run): token ids beyond the vocabulary in
    logit_bias / allowed_token_ids, bad words without a tokenizer. (None, "") when the request has no option."""
    if not params.has_logits_options:
        return None, ""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or ())):
        beyond = sorted(t for t in ids if t >= vocab_size)
        if beyond:
            return None, f"SamplingParams.{name} has token ids beyond the vocabulary (size {vocab_size}): {beyond}"
    if params.bad_words and tokenizer is None:
        return None, "SamplingParams.bad_words needs the runner's tokenizer (load the model with from_pretrained)"
    bad_words = bad_words_token_ids(params.bad_words, tokenizer) if params.bad_words else ()
    beyond = sorted({t for word in bad_words for t in word if t >= vocab_size})
    if beyond:
        return None, f"SamplingParams.bad_words tokenize to ids beyond the vocabulary (size {vocab_size}): {beyond}"
    return RowOptions(bad_words), ""


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's `update_from_tokenizer`: each word tokenized without and with a leading space (the second kept only
    when it is a different word of the same length: the word in the middle of a text)."""
    ids: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            tokens = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if tokens and (not prefix or (tokens[0] != ids[-1][0] and len(tokens) == len(ids[-1]))):
                ids.append(tokens)
    return tuple(tuple(int(t) for t in word) for word in ids)


@dataclass(frozen=True)
class StepOptions:
    """A step's option state over the rows that have options, for positions [t] of each row."""

    rows: list[int]  # the batch rows with options
    params: list[SamplingParams]
    counts: torch.Tensor  # [r, t, v] float32: output token counts at each position (drafts before it counted)
    prompt_seen: torch.Tensor | None  # [r, v] float32 1 at prompt tokens, when a row has a repetition penalty
    static: torch.Tensor | None  # [r, v] float32: logit biases, -inf outside allowed tokens; None: no row has one
    bans: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, position, token ids) at -inf


def step_options(
    requests: list[Any], drafts: torch.Tensor | None, vocab_size: int, device: torch.device
) -> StepOptions | None:
    """The options of a step over `requests` (a sampled step: drafts None; a verification: drafts [b, k], -1 after
    a row's drafts), or None when no request has one (the step then runs exactly as without options)."""
    rows = [row for row, r in enumerate(requests) if r.params.has_logits_options]
    if not rows:
        return None
    chosen = [requests[row] for row in rows]
    for request in chosen:
        _init_state(request, vocab_size, device)
    counts = _caught_up_counts(chosen, device)  # [r, v]
    width = 1 if drafts is None else drafts.shape[1] + 1
    positions = counts[:, None].expand(-1, width, -1)
    row_drafts = [[] for _ in rows]
    if drafts is not None and drafts.shape[1]:
        mine = drafts.to(device)[torch.tensor(rows, device=device)].long()  # [r, k]
        placed = torch.zeros(len(rows), width - 1, vocab_size, device=device)
        placed.scatter_(2, mine.clamp_min(0)[..., None], (mine >= 0).float()[..., None])
        cumulative = torch.cat([placed.new_zeros(len(rows), 1, vocab_size), placed.cumsum(1)], dim=1)
        positions = positions + cumulative
        row_drafts = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in mine.tolist()]
    params = [r.params for r in chosen]
    prompt_seen = None
    if any(p.repetition_penalty != 1 for p in params):
        prompt_seen = torch.stack([_prompt_seen(r, vocab_size, device) for r in chosen])
    static = None
    if any(r.options.static is not None for r in chosen):
        zeros = torch.zeros(vocab_size, device=device)
        static = torch.stack([zeros if r.options.static is None else r.options.static for r in chosen])
    bans = [
        (i, j, tokens)
        for i, (request, drafted) in enumerate(zip(chosen, row_drafts))
        for j in range(width)
        if (tokens := _banned(request, drafted[:j]))
    ]
    return StepOptions(rows, params, positions, prompt_seen, static, bans)


def _init_state(request: Any, vocab_size: int, device: torch.device) -> None:
    """A request's counts row and static logits row, on first use (followers and tests may build requests without
    option state: it is made here from its params, bad words aside)."""
    if request.options is None:
        request.options = RowOptions()
    state, params = request.options, request.params
    if state.counts is None:
        state.counts = torch.zeros(vocab_size, device=device)
        if params.allowed_token_ids is not None or params.logit_bias:
            static = torch.zeros(vocab_size, device=device)
            if params.allowed_token_ids is not None:
                static.fill_(-torch.inf)
                static[torch.tensor(params.allowed_token_ids, device=device)] = 0
            for token, bias in (params.logit_bias or {}).items():
                static[token] += bias
            state.static = static


def _prompt_seen(request: Any, vocab_size: int, device: torch.device) -> torch.Tensor:
    state = request.options
    if state.prompt_seen is None:
        state.prompt_seen = torch.zeros(vocab_size, device=device)
        state.prompt_seen[torch.tensor(request.prompt, dtype=torch.long, device=device)] = 1
    return state.prompt_seen


def _caught_up_counts(requests: list[Any], device: torch.device) -> torch.Tensor:
    """[r, v] float32 output token counts, each request's row caught up with the tokens appended since its last step
    (one scatter-add for all rows); each request keeps its row of the result for the next step."""
    counts = torch.stack([r.options.counts for r in requests])
    at, tokens = [], []
    for i, request in enumerate(requests):
        new = request.output[request.options.num_counted :]
        at += [i] * len(new)
        tokens += new
        request.options.num_counted = len(request.output)
    if tokens:
        index = (torch.tensor(at, device=device), torch.tensor(tokens, device=device))
        counts.index_put_(index, torch.ones(len(tokens), device=device), accumulate=True)
    for i, request in enumerate(requests):
        request.options.counts = counts[i]
    return counts


def _banned(request: Any, drafted: list[int]) -> list[int]:
    """The tokens banned at the position after output + drafted: stop tokens under min_tokens, the last token of
    every bad word whose other tokens end the output (vLLM: the output only, not the prompt)."""
    num_out = len(request.output) + len(drafted)
    banned = sorted(request.stop_token_ids) if num_out < request.params.min_tokens else []
    for word in request.options.bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= num_out and (not prefix or _ends_with(request.output, drafted, prefix)):
            banned.append(word[-1])
    return banned


def _ends_with(output: list[int], drafted: list[int], prefix: list[int]) -> bool:
    """Whether output + drafted ends with prefix (without concatenating the whole output)."""
    n = len(prefix)
    tail = (output[-n:] if n else []) + drafted
    return tail[-n:] == prefix


def apply_options(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logits [b, t, v] → the logits with each row's options applied at every position (float32, a copy), vLLM's
    order: allowed tokens and logit bias, bad words and min_tokens bans, then the repetition, frequency and presence
    penalties. The logits themselves when no row has an option."""
    options: StepOptions | None = batch.options
    if options is None:
        return logits
    every_row = len(options.rows) == logits.shape[0]  # a job's rows usually share their options: no gather
    index = None if every_row else torch.tensor(options.rows, device=logits.device)
    mine = logits.float() if every_row else logits.index_select(0, index).float()  # [r, t, v]
    if mine is logits:  # the raw logits stay as they are for whoever reads them after (raw logprobs)
        mine = mine.clone()
    if options.static is not None:
        mine = mine + options.static[:, None]
    if options.bans:
        rows, positions, tokens = zip(*[(i, j, t) for i, j, ts in options.bans for t in ts])
        mine[list(rows), list(positions), list(tokens)] = -torch.inf
    mine = _penalize(mine, options)
    if every_row:
        return mine
    processed = logits.float()
    if processed is logits:
        processed = processed.clone()
    return processed.index_copy_(0, index, mine)


def _penalize(logits: torch.Tensor, options: StepOptions) -> torch.Tensor:
    """vLLM's `apply_penalties` at every position, in place on the step's own copy: repetition over prompt and
    output (positive logits divided, the others multiplied), then − frequency · count − presence · [count > 0] over
    the output. A penalty a row does not set is an exact no-op on it (· 1, − 0). Without `torch.where` and boolean
    temporaries (each ~10× an arithmetic pass on CPU): for p ≥ 1 the repetition rule is min(x / p, x · p), for p < 1
    the max, i.e. s · min(s·x / p, s·x · p) with s = ±1 per row (exact: a sign flip rounds nothing)."""
    params, counts, device = options.params, options.counts, logits.device
    presence_or_repetition = options.prompt_seen is not None or any(p.presence_penalty for p in params)
    seen = counts.clamp(max=1) if presence_or_repetition else None  # [r, t, v]: 1 where the output holds the token
    if options.prompt_seen is not None:
        # Few temporaries, in place where possible: each fresh [r, t, v] tensor costs more than its arithmetic.
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None, None]
        penalties = torch.maximum(seen, options.prompt_seen[:, None]).mul_(repetition - 1).add_(1)
        sign = torch.where(repetition < 1, -1.0, 1.0) if any(p.repetition_penalty < 1 for p in params) else None
        if sign is not None:
            logits.mul_(sign)
        divided = logits / penalties
        torch.minimum(logits.mul_(penalties), divided, out=logits)
        if sign is not None:
            logits.mul_(sign)
    if any(p.frequency_penalty for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None, None]
        logits.addcmul_(counts, frequency, value=-1)
    if any(p.presence_penalty for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None, None]
        logits.addcmul_(seen, presence, value=-1)
    return logits
