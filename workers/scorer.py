"""Scoring: log p(token t+1 | tokens ≤ t) for every position of every sequence, in padded batched forwards.

Sequences that share a long prefix (an evaluation set's instructions or few-shot block) compute it once: the
prefix runs alone up to a checkpoint position (a multiple of `workers/prefix_cache.py`'s checkpoint multiple, so a
continued forward computes what one over the whole sequence does), its states and KV are copied into each
sequence's slot, and only the rest runs per sequence. The prefix's log-probs are shared; the first token after it
is scored from the prefix's last hidden state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.model import ForwardBatch, HybridModel, StatePool
from workers.prefix_cache import CHECKPOINT_MULTIPLE, MIN_PREFILL_REST, common_prefix_length

SCORE_LOGITS_CHUNK = 1024  # logits for this many positions at a time


@dataclass
class _Prefix:
    """A prefix's computed part: log-probs of its tokens 1 … n-1, states and KV after it, its last hidden state."""

    logprobs: list[float]
    pool: StatePool  # one slot holding the states and KV after the prefix
    last_hidden: torch.Tensor  # [d]: the prefix's final-norm hidden state at its last position


class Scorer:
    """Scores sequences with a model: batched forwards within a token budget, shared prefixes computed once."""

    def __init__(
        self,
        model: HybridModel,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        multiple: int,
        share_prefixes: bool = True,
    ):
        """`multiple`: shared prefixes end at multiples of it (see the module docstring)."""
        self.model, self.max_num_seqs, self.budget = model, max_num_seqs, max_num_batched_tokens
        self.multiple, self.share_prefixes = max(CHECKPOINT_MULTIPLE, multiple), share_prefixes
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.num_shared_tokens = 0  # prefix tokens computed once for several sequences, over the scorer's life
        self.on_forward: Callable[[], None] | None = None  # set by each `score` call

    @torch.inference_mode()
    def score(
        self, sequences: Sequence[Sequence[int]], on_forward: Callable[[], None] | None = None
    ) -> list[list[float]]:
        """Per sequence (each ≥ 1 token), its token log-probs. `on_forward`: called after every forward (a worker's
        heartbeat: `workers/heartbeat.py`)."""
        self.on_forward = on_forward
        out: list[list[float] | None] = [None] * len(sequences)
        for members, prefix_len in self._prefix_groups(sequences):
            prefix = self._prefix(list(sequences[members[0]][:prefix_len])) if prefix_len else None
            if prefix is not None:
                self.num_shared_tokens += prefix_len * (len(members) - 1)
            members.sort(key=lambda i: len(sequences[i]))  # similar lengths together: little padding
            for batch in self._batches(members, sequences, prefix_len):
                rests = [list(sequences[i][prefix_len:]) for i in batch]
                for i, logprobs in zip(batch, self._score_batch(rests, prefix, prefix_len)):
                    out[i] = logprobs
        return out  # type: ignore[return-value]

    def _prefix_groups(self, sequences: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
        """Sequences in groups that share a prefix (its length a multiple of `multiple`, 0: nothing shared)."""
        order = sorted(range(len(sequences)), key=lambda i: tuple(sequences[i]))  # shared prefixes side by side
        groups: list[tuple[list[int], int]] = []
        for i in order:
            if self.share_prefixes and groups:
                members, shared = groups[-1]
                head = sequences[members[0]]
                limit = min(len(sequences[j]) for j in [*members, i]) - MIN_PREFILL_REST
                length = min(common_prefix_length(head, sequences[i]), limit, shared or 1 << 62)
                length = max(0, length) // self.multiple * self.multiple
                if length > 0:
                    groups[-1] = (members + [i], length)
                    continue
            groups.append(([i], 0))
        shared = [(members, length) for members, length in groups if len(members) > 1]
        alone = [members[0] for members, _ in groups if len(members) == 1]
        return shared + ([(alone, 0)] if alone else [])

    def _batches(self, members: list[int], sequences: Sequence[Sequence[int]], prefix_len: int) -> list[list[int]]:
        """Members (sorted by length) in padded batches of at most max_num_seqs rows and the token budget."""
        batches: list[list[int]] = [[]]
        for i in members:
            batch = batches[-1]
            padded = (len(batch) + 1) * (len(sequences[i]) - prefix_len)  # sorted: the newcomer is the longest
            if batch and (len(batch) == self.max_num_seqs or padded > self.budget):
                batches.append([])
            batches[-1].append(i)
        return batches

    def _prefix(self, tokens: list[int]) -> _Prefix:
        """Run a shared prefix alone (in chunks of the budget): its log-probs, states, KV and last hidden state."""
        pool = StatePool(self.model.config, 1, len(tokens), self.device, self.dtype)
        logprobs, hidden = self._forward([tokens], pool, None, 0)
        return _Prefix(logprobs[0], pool, hidden[0])

    def _score_batch(self, rests: list[list[int]], prefix: _Prefix | None, start: int) -> list[list[float]]:
        """Sequences' tokens after a shared prefix (all of them without one), continuing from it."""
        lengths = [len(r) for r in rests]
        pool = StatePool(self.model.config, len(rests), start + max(lengths), self.device, self.dtype)
        if prefix is None:
            return self._forward(rests, pool, None, 0)[0]
        slots = torch.arange(len(rests), device=self.device)
        for slot in range(len(rests)):  # every slot starts as the prefix's slot left off
            pool.conv[:, slot], pool.ssm[:, slot] = prefix.pool.conv[:, 0], prefix.pool.ssm[:, 0]
        keys, values = prefix.pool.slot_kv(0, start)  # [layers, kv_heads, start, hd]
        if keys.shape[0]:
            where = torch.arange(start, device=self.device)
            for slot in range(len(rests)):
                index = pool.kv_caches()[0].token_index(slots[slot : slot + 1], where[None])[0]
                pool.key[:, :, index], pool.value[:, :, index] = keys, values
        first = torch.tensor([r[0] for r in rests], device=self.device)
        head = self.model.logits(prefix.last_hidden[None]).log_softmax(-1)[0, first].tolist()
        scored, _ = self._forward(rests, pool, pool.read(slots), start)
        return [prefix.logprobs + [h] + s for h, s in zip(head, scored)]

    def _forward(self, rows: list[list[int]], pool: StatePool, states: list | None, start: int):
        """Rows from position `start` (their states in `states`, None: from zero), one padded forward, or chunks of
        the budget for a single row: (log p of each row's tokens 1 … n-1 after `start`, each row's last hidden)."""
        lengths = [len(r) for r in rows]
        input_ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        for row, tokens in enumerate(rows):
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
        input_ids = input_ids.to(self.device)
        slots = torch.arange(len(rows), device=self.device)
        chunk = max(lengths) if len(rows) > 1 else self.budget
        out: list[list[float]] = [[] for _ in rows]
        last = [None] * len(rows)
        for offset in range(0, max(lengths), chunk):
            stop = min(offset + chunk, max(lengths))
            num_tokens = (torch.tensor(lengths, device=self.device) - offset).clamp(0, stop - offset)
            batch = ForwardBatch(slots, torch.full_like(num_tokens, start + offset), num_tokens)
            forward = self.model(input_ids[:, offset:stop], batch, states, pool.kv_caches())
            if self.on_forward is not None:
                self.on_forward()
            states = forward.mamba_states
            for row, length in enumerate(lengths):  # position t predicts token t + 1
                out[row] += self._logprobs(forward.hidden[row], input_ids[row], offset, min(stop, length - 1))
                if offset < length <= stop:
                    last[row] = forward.hidden[row, length - 1 - offset]
        if states is not None:
            pool.write(slots, states)
        return out, last

    def _logprobs(self, hidden: torch.Tensor, token_ids: torch.Tensor, start: int, stop: int) -> list[float]:
        """log p(token t+1 | ≤ t) for positions start … stop-1, from `hidden` [chunk, d] whose row 0 is `start`."""
        values: list[float] = []
        for first in range(start, stop, SCORE_LOGITS_CHUNK):  # bounded [chunk, vocab] logits at a time
            last = min(first + SCORE_LOGITS_CHUNK, stop)
            logprobs = self.model.logits(hidden[first - start : last - start]).log_softmax(-1)
            values += logprobs.gather(-1, token_ids[first + 1 : last + 1, None]).squeeze(-1).tolist()
        return values
