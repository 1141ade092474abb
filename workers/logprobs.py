"""Log-probabilities of generated tokens (vLLM's `SamplingParams.logprobs` and `logprobs_mode`).

A request with `logprobs = k` gets, at every generated position, the log-probability of the token it took and of
the k most likely tokens, from the target's own distribution at that position: the prefill's last logits for the
first token, a decode step's logits, and under speculation the verification logits at the accepted positions (never
the draft's). One batched op per step over the rows that asked — log-softmax, top-k, gather — and one device→host
copy.

Modes (vLLM's names): "raw_logprobs" (default) is the log-softmax of the model's logits; "processed_logprobs" that
of the logits the row samples from (`workers.sampling.processed_logits`: the grammar mask, the logits options of
`workers/logits_processors.py` — penalties, biases, bans — temperature, min-p, top-k and top-p applied, the excluded
tokens at -inf; greedy rows unscaled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from workers.model.kernels import native
from workers.sampling import SamplingBatch, processed_logits

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"
LOGPROBS_MODES = (RAW, PROCESSED)
_SHORT_NAMES = {"raw": RAW, "processed": PROCESSED}


def logprobs_mode_name(mode: Any) -> str | None:
    """The mode's vLLM name ("raw" and "processed" stand for "raw_logprobs" and "processed_logprobs"), or None when
    `mode` is none of them."""
    if not isinstance(mode, str):
        return None
    mode = _SHORT_NAMES.get(mode, mode)
    return mode if mode in LOGPROBS_MODES else None


def logprobs_entry(top_ids: list[int], top_logprobs: list[float], token: int, token_logprob: float) -> dict[int, float]:
    """One position's {token_id: logprob} (vLLM's shape): the top k in rank order, then the taken token unless it is
    among them (k or k + 1 entries; the whole vocabulary where it is smaller than k)."""
    entry = {t: lp for t, lp in zip(top_ids, top_logprobs) if t >= 0}  # −1: past a vocabulary smaller than k
    entry.setdefault(token, token_logprob)
    return entry


@dataclass(frozen=True)
class StepLogprobs:
    """One step's logprobs on the host, for the rows that asked."""

    rows: dict[int, int]  # batch row → its row in `values`
    num_logprobs: list[int]  # k per batch row (0 for rows that did not ask)
    width: int  # the k the top-k ran with (the largest a row asked for)
    values: list[list[list[float]]]  # [asking rows, positions, 2 + 2·width]: token, its logprob, top ids, top logprobs

    def record(self, request: Any, row: int, num_positions: int) -> None:
        """Give `request` (batch row `row`) the entries of its first `num_positions` positions."""
        at = self.rows.get(row)
        if at is None:
            return
        k, width = self.num_logprobs[row], self.width
        for position in self.values[at][:num_positions]:
            token, token_logprob = int(position[0]), position[1]
            top_ids = [int(t) for t in position[2 : 2 + k]]
            entry = logprobs_entry(top_ids, position[2 + width : 2 + width + k], token, token_logprob)
            request.record_logprobs(entry, token_logprob)


def step_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch, mode: str
) -> StepLogprobs | None:
    """Logits [b, t, v] and the token taken at each position, token_ids [b, t] (any value where none was: the
    entries past a row's accepted tokens are never read) → the rows' logprobs on the host, or None when no row asked.

    1. processed mode turns the logits into what each row samples; the rows that asked are selected (all: no copy);
    2. log-softmax in float32, the taken tokens' logprobs gathered, the top k (the largest any row asked)
       (`_logprobs_table`);
    3. one tensor [rows, t, 2 + 2k] (float64 holds token ids exactly) → one device→host copy."""
    rows = batch.logprob_rows
    if not rows:
        return None
    num_logprobs = [p.logprobs or 0 for p in batch.params]
    width = max(num_logprobs[row] for row in rows)
    if mode == PROCESSED:  # over the whole batch: every per-row field of the batch (masks …) lines up with it
        logits = processed_logits(logits, batch)
    if len(rows) < len(batch.params):
        index = torch.tensor(rows, device=logits.device)
        logits, token_ids = logits.index_select(0, index), token_ids.to(logits.device).index_select(0, index)
    token_ids = token_ids.to(logits.device).long().clamp_min(0)  # [r, t]
    values = _logprobs_table(logits.float(), token_ids, width).tolist()
    return StepLogprobs({row: at for at, row in enumerate(rows)}, num_logprobs, width, values)


def _logprobs_table(logits: torch.Tensor, token_ids: torch.Tensor, width: int) -> torch.Tensor:
    """float32 logits [r, t, v], token_ids [r, t] → [r, t, 2 + 2·width] float64: token, its logprob, the top ids,
    their logprobs. On CPU the native kernel (two reads of the logits, no log-softmax written out: ~0.15 ms at
    32 × 32k against ~0.8 ms); torch's log_softmax, gather and topk elsewhere. Top entries past the vocabulary are
    (id −1, −inf), as the kernel leaves them (`logprobs_entry` drops them)."""
    r, t, v = logits.shape
    if native.loaded() and native.fits(logits):
        token_logprobs, top_ids, top_logprobs = native.logprobs(logits.view(-1, v), token_ids.view(-1), width)
        parts = [token_ids.view(-1, 1), token_logprobs[:, None], top_ids, top_logprobs]
        return torch.cat([part.double() for part in parts], dim=-1).view(r, t, -1)
    logprobs = logits.log_softmax(-1)  # [r, t, v]
    parts = [token_ids[..., None].double(), logprobs.gather(-1, token_ids[..., None]).double()]
    if width:
        top = logprobs.topk(min(width, v), dim=-1)
        missing = (r, t, width - top.indices.shape[-1])
        parts += [top.indices.double(), logprobs.new_full(missing, -1).double()]
        parts += [top.values.double(), logprobs.new_full(missing, -math.inf).double()]
    return torch.cat(parts, dim=-1)
