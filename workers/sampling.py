"""Sampling parameters (vLLM's names) and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.model.kernels import native
from workers.structured_outputs import StructuredOutputsParams, masked_logits, tokens_allowed

# An empty place in a step's output rows: a verification's row holds its valid tokens from column 0, then these.
PLACEHOLDER_TOKEN_ID = -1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top logprobs per generated position at most


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, with vLLM's field names and defaults.

    temperature 0 means greedy. `seed` (any integer, used modulo 2^64) makes a request's samples reproducible
    whatever else is in the batch; without one, each request draws a fresh seed from the runner's OS-seeded stream.
    Generation stops at `max_tokens`, at any of `stop_token_ids` (plus the model's eos unless `ignore_eos`), or
    when the text contains one of the `stop` strings (the text is cut before it). `logprobs` = k (vLLM's meaning)
    returns, at every generated position, the log-probability of the sampled token and of the k most likely ones
    (None: no logprobs; see `workers/logprobs.py`). `n` samples of the prompt are
    generated (its prompt prefilled once, `workers/samples.py`); sample j > 0 of a seeded request draws from
    `sample_seed(seed, j)`. `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar
    (`workers/structured_outputs.py`). The text: `include_stop_str_in_output` keeps a matched stop string (and a
    final stop token's text) instead of cutting it; `skip_special_tokens` leaves special tokens out of the text;
    `spaces_between_special_tokens` False writes two adjacent added tokens without the space the decoder puts
    between them (`workers/detokenize.py`).

    The logits options, vLLM's meanings (`workers/logits_processors.py`, applied at every verification position
    with the drafts before it as if generated): `presence_penalty` / `frequency_penalty` (in [-2, 2]) subtract
    presence · [count > 0] + frequency · count over the output tokens so far; `repetition_penalty` (> 0) divides
    positive logits and multiplies negative ones of every token in the prompt or the output; `min_p` (in [0, 1])
    drops tokens whose probability is below min_p · the top one's (after temperature); `min_tokens` masks eos and
    `stop_token_ids` until that many tokens are out; `logit_bias` {token id: bias} adds to the logits;
    `bad_words` are banned (tokenized with and without a leading space; a word's last token is banned when the
    output ends with its other tokens); `allowed_token_ids` restricts sampling to these tokens.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _normalize_options(self)
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer ≥ 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number ≥ 0 (0 = greedy)"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer ≥ 0 (0 = off)"),
            (
                "seed",
                self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
                "an integer (used modulo 2^64) or None",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "token ids ≥ 0"),
            (
                "logprobs",
                self.logprobs is None or (_is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"None (no logprobs) or an integer in [0, {MAX_LOGPROBS}] (the sampled token's logprob plus the top k)",
            ),
            ("n", isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "an integer ≥ 1"),
            (
                "structured_outputs",
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                "a StructuredOutputsParams or None",
            ),
            *_option_checks(self),
        ]
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            checks.append((name, isinstance(getattr(self, name), bool), "True or False"))
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token."""
        return self.temperature == 0

    @property
    def has_logits_options(self) -> bool:
        """Whether any option that reads the request's tokens or edits its logits is set (min_p aside: it is part of
        `sampling_logits`); rows without one sample exactly as before these options existed."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.min_tokens
            or self.logit_bias
            or self.bad_words
            or self.allowed_token_ids is not None
        )


def _normalize_options(params: SamplingParams) -> None:
    """Tuples for the sequence options (a single bad word string stands for one), a plain dict for logit_bias (JSON
    keys are strings: "42" stands for token 42)."""
    if isinstance(params.bad_words, str):
        object.__setattr__(params, "bad_words", (params.bad_words,))
    for name in ("bad_words", "allowed_token_ids"):
        value = getattr(params, name)
        if isinstance(value, (list, tuple)):  # anything else is left for the checks to name
            object.__setattr__(params, name, tuple(value))
    if isinstance(params.logit_bias, dict):
        try:
            bias = {int(k): v for k, v in params.logit_bias.items()}
        except (TypeError, ValueError):
            return  # the check below names the field
        object.__setattr__(params, "logit_bias", bias)


def _option_checks(p: SamplingParams) -> list[tuple[str, bool, str]]:
    """The logits options' checks (vLLM's ranges); token ids beyond the vocabulary are refused at admission."""
    bias = p.logit_bias
    return [
        ("presence_penalty", _is_number(p.presence_penalty) and -2 <= p.presence_penalty <= 2, "a number in [-2, 2]"),
        (
            "frequency_penalty",
            _is_number(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2,
            "a number in [-2, 2]",
        ),
        ("repetition_penalty", _is_number(p.repetition_penalty) and p.repetition_penalty > 0, "a number > 0 (1 = off)"),
        ("min_p", _is_number(p.min_p) and 0 <= p.min_p <= 1, "a number in [0, 1] (0 = off)"),
        (
            "min_tokens",
            _is_integer(p.min_tokens)
            and p.min_tokens >= 0
            and (not _is_integer(p.max_tokens) or p.min_tokens <= p.max_tokens),
            "an integer in [0, max_tokens]",
        ),
        (
            "logit_bias",
            bias is None
            or (
                isinstance(bias, dict)
                and all(_is_integer(t) and t >= 0 and _is_number(b) and math.isfinite(b) for t, b in bias.items())
            ),
            "None or a dict {token id ≥ 0: finite bias}",
        ),
        (
            "bad_words",
            isinstance(p.bad_words, tuple) and all(isinstance(w, str) and w.strip() for w in p.bad_words),
            "a list of non-blank strings",
        ),
        (
            "allowed_token_ids",
            p.allowed_token_ids is None
            or (
                isinstance(p.allowed_token_ids, tuple)
                and len(p.allowed_token_ids) > 0
                and all(_is_integer(t) and t >= 0 for t in p.allowed_token_ids)
            ),
            "None or a non-empty list of token ids ≥ 0",
        ),
    ]


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


SEED_RANGE = 2**64  # torch generators take 64-bit seeds: any integer seed is used modulo this


def make_generator(params: SamplingParams, device: torch.device, fallback_seed: int) -> torch.Generator:
    """The request's own random stream: its seed (modulo 2^64), or a fresh one from the runner when it has none."""
    generator = torch.Generator(device=device)
    generator.manual_seed((params.seed if params.seed is not None else fallback_seed) % SEED_RANGE)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., v] → the distribution a request samples from: temperature, then top-k, then top-p."""
    return sampling_logits(logits, params).softmax(-1)


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., v] → the logits a sampled request draws from (float32): temperature, then min-p, top-k, top-p
    (vLLM's order), the tokens they exclude at -inf."""
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), -torch.inf)
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p (the top one always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    return logits


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [v] (non-negative weights) with the request's generator (`sample_rows`)."""
    return sample_rows(probs[None], [generator])[0]


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token per row of probs [r, v], row i drawn with generators[i]: one uniform u per row, then the first
    token whose cumulative weight (float64) exceeds u · the row's total — the inverse CDF, so a token of weight 0 is
    never drawn. One random number per token: the exponential race (argmax p / Exp(1)) drew v of them, ~0.5 ms per
    row at v = 32k on CPU, more than the model's decode step at batch 32."""
    uniforms = [torch.rand((), dtype=torch.float64, generator=g, device=g.device) for g in generators]
    cdf = probs.double().cumsum(-1)
    target = torch.stack(uniforms).to(cdf.device)[:, None] * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].tolist()
    # u · total rounds up to the total once in ~2^53 draws (searchsorted then answers v): the last token of weight > 0.
    v = probs.shape[-1]
    return [token if token < v else int(probs[row].nonzero()[-1]) for row, token in enumerate(drawn)]


def _sample_rows_of(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One sampled token per row of logits [r, v] (row i with params[i], generators[i]); rows with the same
    temperature, min-p, top-k and top-p share one `target_probs` call (a batch job's rows usually all do)."""
    groups: dict[tuple[float, float, int, float], list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault((p.temperature, p.min_p, p.top_k, p.top_p), []).append(row)
    tokens = [0] * len(params)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        probs = target_probs(logits.index_select(0, index), params[rows[0]])
        for row, token in zip(rows, sample_rows(probs, [generators[row] for row in rows])):
            tokens[row] = token
    return tokens


@dataclass(frozen=True)
class SamplingBatch:
    """A step's per-row sampling state, one value: what sampling and acceptance read for each row. A feature that
    changes how rows sample (a grammar mask, logprobs, penalties, n samples) adds a field here and a function that
    reads it, not a branch in the step."""

    params: list[SamplingParams]
    generators: list[torch.Generator]
    # xgrammar token bitmasks (int32, a bit per token), one row per position a token is chosen at: [b, words] for a
    # sampled step, [b, k + 1, words] for a verification; rows without a constraint allow every token. None: no row
    # of the step has a constraint.
    masks: torch.Tensor | None = None
    # The step's logits options (`workers.logits_processors.StepOptions`: penalties, biases, bans at every position
    # a token is chosen at); None: no row of the step has one.
    options: Any | None = None

    @property
    def all_greedy(self) -> bool:
        """Whether every row takes the argmax token."""
        return all(p.greedy for p in self.params)

    @property
    def logprob_rows(self) -> list[int]:
        """The rows that asked for logprobs (`SamplingParams.logprobs` set)."""
        return [row for row, p in enumerate(self.params) if p.logprobs is not None]


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logits [b, ..., v] (row i: request i's positions) → what each row samples from, as float32 logits (vLLM's
    "processed": after every processor, temperature and top-k/top-p included): a sampled row's `sampling_logits`; a
    greedy row's logits unscaled (vLLM samples greedy rows at temperature 1 and without top-k/top-p); grammar masks
    first (`apply_masks`)."""
    logits = apply_masks(logits, batch)
    processed = logits.float()
    sampled = [row for row, p in enumerate(batch.params) if not p.greedy]
    if sampled:
        processed = processed.clone()
        for row in sampled:
            processed[row] = sampling_logits(logits[row], batch.params[row])
    return processed


def apply_masks(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits [b, v] or [b, k + 1, v] with every row's grammar mask applied (disallowed tokens −inf), a float32
    copy (the raw logits stay as they are for whoever reads them after); the logits themselves when no row has a
    constraint."""
    if batch.masks is None:
        return logits
    return masked_logits(logits, batch.masks)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """One next token per row of logits [b, v] (grammar masks applied first)."""
    if batch.masks is not None:
        return _sample_masked(logits, batch)
    tokens = _argmax(logits).tolist()
    _sample_into(tokens, logits, list(range(len(tokens))), batch)
    return tokens


def _sample_into(tokens: list[int], logits: torch.Tensor, rows: list[int], batch: SamplingBatch) -> None:
    """tokens[rows[i]] = a token sampled from logits[i] for each of `rows` that is not greedy."""
    sampled = [i for i, row in enumerate(rows) if not batch.params[row].greedy]
    if not sampled:
        return
    index = torch.tensor(sampled, device=logits.device)
    chosen = [rows[i] for i in sampled]
    drawn = _sample_rows_of(
        logits.index_select(0, index), [batch.params[r] for r in chosen], [batch.generators[r] for r in chosen]
    )
    for row, token in zip(chosen, drawn):
        tokens[row] = token


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension of logits [b, v]."""
    if native.loaded() and native.fits(logits) and logits.dim() == 2:
        return native.argmax(logits)  # one pass per row instead of torch's ~1 ms at 32 × 32k on CPU
    return logits.argmax(-1)


def _sample_masked(logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """`sample` under grammar masks, masking only the rows where it matters: sampled rows, and greedy rows whose
    argmax the grammar forbids — a legal argmax *is* the masked argmax (masking only removes tokens)."""
    top = _argmax(logits)
    legal = tokens_allowed(batch.masks, top).tolist()
    tokens = top.tolist()
    rows = [row for row, p in enumerate(batch.params) if not p.greedy or not legal[row]]
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    masked = masked_logits(logits[index], batch.masks[index.to(batch.masks.device)])
    for row, token in zip(rows, _argmax(masked).tolist()):
        tokens[row] = token
    _sample_into(tokens, masked, rows, batch)
    return tokens
