"""MTP proposer: the target checkpoint's own multi-token-prediction head drafts k tokens, chained.

The head (Qwen3-Next / Qwen3.5 or Nemotron-H, `workers/model/layers/mtp.py`) reads the target's final-norm hidden
states, so the scheduler hands them over after every target forward (`observe_target`: prompt positions at prefill, the
accepted inputs of a verification, the one input of a plain decode step). Invariant: the KV cache of each of the
head's attention blocks (paged over the target's block table) holds the entries (h_t, token t+1) of positions
0 … c-1, and `pending[slot]` holds the target hidden states of positions c … N-2 that it has not consumed yet
(N = the request's token count). A proposal first catches up on them — writing their keys/values, which
overwrites the speculative entries of the previous chain — and the last one's output drafts d_1; each further
draft feeds the head its own output state and the previous draft. So after a step with n accepted tokens, the next
proposal's catch-up leaves the KV holding exactly the accepted positions; nothing needs shifting on `accepted`.
On CPU float32 the head's steps run as an MTP plan (`workers/model/steps/mtp_plan.py`): a catch-up of up to 2 (k + 1)
positions per row and, for greedy requests, the whole chain in one native call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model import ForwardBatch, HybridModel, KVCache, StatePool
from workers.model.kv_blocks import BlockTable
from workers.model.state import free_storage, paged_kv_cache
from workers.model.steps import mtp_plan
from workers.model.steps.mtp_plan import MtpPlan
from workers.requests import Request
from workers.spec_decode.proposal import Proposal, Proposer, choose_draft_token, empty_draft_probs

# A row's pending hidden states beyond this many positions are consumed at once (the head catches up on those whose
# next token is known), so a long plain stretch or a long prompt never accumulates them: memory stays bounded by
# `pending_bytes`, and the work is what the next proposal would do anyway.
MAX_PENDING_POSITIONS = 64


def pending_bytes(
    hidden_size: int, dtype: torch.dtype, max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int
) -> int:
    """An upper bound of the target hidden states an `MtpProposer` holds: per slot the bounded pending positions of
    the steps they came from (a step's copy [b, k + 1, d] stays alive while any row still points into it), and one
    prompt chunk's before its catch-up."""
    element = torch.empty(0, dtype=dtype).element_size()
    steps = (MAX_PENDING_POSITIONS + 1) * max_num_seqs * (num_speculative_tokens + 1)
    return (steps + max_num_batched_tokens) * hidden_size * element


class MtpProposer(Proposer):
    """Proposes k tokens per request with `model.mtp` (see the module docstring for the state it keeps)."""

    drafts_from_hidden = True

    def __init__(self, model: HybridModel, num_speculative_tokens: int = 1, decode_plan: bool = True):
        """`model` must have been loaded with its MTP head (`load_checkpoint(..., mtp=True)`). `decode_plan`: run the
        head's steps as an MTP plan where it allows (`workers/model/steps/mtp_plan.py`; False keeps the module path)."""
        if model.mtp is None:
            raise ValueError("speculative method 'mtp' needs the target loaded with its MTP head (mtp=True)")
        self.model, self.head = model, model.mtp
        self.num_speculative_tokens = num_speculative_tokens
        self.device = model.embed_tokens.weight.device
        self.caches: list[KVCache] = []  # one per attention block of the head
        self.max_chunk_tokens = 2048  # set by `start` to the scheduler's token budget
        self.pending: dict[int, _Pending] = {}  # slot → target hidden states not consumed yet
        self.planned = decode_plan and mtp_plan.unsupported_reason(model) is None
        self.plan: MtpPlan | None = None
        self._blocks: BlockTable | None = None  # the block table the caches are paged over

    def start(self, pool: StatePool, max_chunk_tokens: int) -> None:
        """Allocate the head's KV caches: one per attention block, paged over the target's blocks (same positions).
        A runner's next run on the same slots (its workspace reused) keeps them, and the plan's records."""
        if self._blocks is not pool.blocks:
            dtype = self.model.embed_tokens.weight.dtype
            self.caches = [
                paged_kv_cache(pool.blocks, self.model.config, self.device, dtype)
                for _ in range(self.head.num_attention_blocks)
            ]
            k = self.num_speculative_tokens  # feeds of up to 2 (k + 1) positions: a few plain steps between drafts
            self.plan = MtpPlan(self.model, self.caches, pool.num_slots, 2 * (k + 1), k) if self.planned else None
            self._blocks = pool.blocks
        self.max_chunk_tokens = max_chunk_tokens
        self.pending = {}

    def release(self) -> None:
        """Free the head's KV caches and plan now (the target's workspace is being replaced by a larger one)."""
        for cache in self.caches:
            free_storage(cache.key)
            free_storage(cache.value)
        self.caches, self.plan, self._blocks, self.pending = [], None, None, {}

    def move(self, source: int, target: int) -> None:
        """Follow a request to its new slot (its KV blocks move with the target's block table). What the target slot
        held belonged to a finished request; the moved one may have nothing pending yet (admitted, no chunk run)."""
        self.pending.pop(target, None)
        if source in self.pending:
            self.pending[target] = self.pending.pop(source)

    def resume_from(self, request: Request, position: int, hidden: torch.Tensor) -> None:
        """A request restored from the prefix cache: the head's KV holds positions before `position` (shared), and
        catches up from `position`, whose target hidden state the cache kept (`hidden` [d])."""
        self.pending[request.slot] = _Pending(position, [hidden[None].clone()], 1)

    def prepare_fork(self, source: Request) -> None:
        """Catch the head up on the prompt's positions but the last (whose entry pairs it with each sample's own next
        token), once for all samples."""
        self.consume_known([source])

    def fork(self, source: Request, targets: list[Request]) -> None:
        """Each sample holds the prompt's last hidden state pending, as its own copy."""
        pending = self.pending.get(source.slot)
        for target in targets:
            if pending is None:
                self.pending.pop(target.slot, None)
            else:
                hidden = torch.cat(pending.pieces) if len(pending.pieces) > 1 else pending.pieces[0].clone()
                self.pending[target.slot] = _Pending(pending.start, [hidden], pending.count)

    def admit(self, requests: list[Request]) -> None:
        """New requests start with nothing cached (their prefill's hidden states arrive next)."""
        for request in requests:
            self.pending.pop(request.slot, None)

    def observe_target(
        self, requests: list[Request], hidden: torch.Tensor, cache_lens: list[int], num_tokens: list[int]
    ) -> None:
        """The target's final-norm hidden [b, l, d] of a forward whose row i started at position cache_lens[i];
        its first num_tokens[i] positions are now part of the request (the rest was rejected or padding)."""
        # A decode or verification step: one copy for every row (the rows' pieces are views of it); a prompt chunk:
        # a copy per row, without its padding.
        block = hidden.detach().clone() if hidden.shape[1] <= self.num_speculative_tokens + 1 else None
        for row, request in enumerate(requests):
            new = block[row, : num_tokens[row]] if block is not None else hidden[row, : num_tokens[row]].clone()
            pending = self.pending.get(request.slot)
            if pending is None:
                self.pending[request.slot] = _Pending(cache_lens[row], [new], new.shape[0])
            else:
                assert pending.start + pending.count == cache_lens[row], "target positions must follow on"
                pending.pieces.append(new)
                pending.count += new.shape[0]
        over = [r for r in requests if self.pending[r.slot].count > MAX_PENDING_POSITIONS]
        if over:
            self.consume_known(over)

    def consume_known(self, requests: list[Request]) -> None:
        """Catch the head up on the pending positions whose next token is already known (all but the latest ones),
        keeping only the rest pending, as a copy: the big tensors they came from can go."""
        rows, taken = [], []
        for request in requests:
            pending = self.pending.get(request.slot)
            if pending is None:
                continue
            num_known = min(pending.count, request.num_tokens - 1 - pending.start)  # token t + 1 known for t < N-1
            if num_known <= 0:
                continue
            hidden = pending.pieces[0] if len(pending.pieces) == 1 else torch.cat(pending.pieces)
            rows.append(request)
            taken.append(_Pending(pending.start, [hidden[:num_known]], num_known))
            rest = hidden[num_known:].clone()
            self.pending[request.slot] = _Pending(pending.start + num_known, [rest], rest.shape[0])
        if rows:
            self._catch_up(rows, taken)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        """k_i = num_drafts[i] drafts per request; rows with 0 keep their pending hidden states for later."""
        rows = [i for i, k in enumerate(num_drafts) if k > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        if not rows:
            return Proposal.from_lists(drafts, None)
        active, budgets = [requests[i] for i in rows], [num_drafts[i] for i in rows]
        sampled = any(not r.params.greedy for r in active)
        probs = empty_draft_probs(len(requests), max(budgets), self.model.config.vocab_size, sampled, self.device)
        taken = [self.pending.pop(r.slot) for r in active]
        feed_limit = self.plan.tokens_per_row if self.plan is not None else self.num_speculative_tokens + 1
        caught_up = max(p.count for p in taken) > feed_limit  # a prompt, or many skipped steps
        if self.plan is not None:
            chains = self._propose_planned(active, taken, budgets, probs, rows)
        else:
            chains = self._propose_module(active, taken, budgets, probs, rows)
        for row, i in enumerate(rows):
            drafts[i] = chains[row][: budgets[row]]
        return Proposal.from_lists(drafts, probs, caught_up)

    def _propose_planned(
        self,
        active: list[Request],
        taken: list[_Pending],
        budgets: list[int],
        probs: torch.Tensor | None,
        rows: list[int],
    ) -> list[list[int]]:
        """`propose` through the MTP plan: all greedy, the catch-up and the whole chain in one native call; else one
        call per step, the drafts chosen here. Pending runs longer than the plan takes (new prompts) catch up
        module by module and chain through the plan from there."""
        plan, num_steps, slots = self.plan, max(budgets), [r.slot for r in active]
        if max(p.count for p in taken) <= plan.tokens_per_row:
            token_ids = [_context(r, p.start + 1, p.start + 1 + p.count) for r, p in zip(active, taken)]
            plan.stage_feed(slots, [p.start for p in taken], token_ids, [p.pieces for p in taken])
        else:
            plan.stage_output(slots, self._catch_up(active, taken), [p.start + p.count for p in taken])
        if all(r.params.greedy and r.grammar is None for r in active):  # constrained rows: masked drafts, below
            return plan.greedy(num_steps).T.tolist()  # [b, k]
        logits = plan.feed()
        chains: list[list[int]] = [[] for _ in active]
        for step in range(num_steps):
            for row, request in enumerate(active):
                chains[row].append(
                    choose_draft_token(logits[row], request, step < budgets[row], probs, rows[row], step)
                )
            if step + 1 < num_steps:
                logits = plan.step(step + 1, [chain[-1] for chain in chains])
        return chains

    def _propose_module(
        self,
        active: list[Request],
        taken: list[_Pending],
        budgets: list[int],
        probs: torch.Tensor | None,
        rows: list[int],
    ) -> list[list[int]]:
        """`propose` module by module: the catch-up's last output drafts d_1; each further draft feeds the head its
        own output and the previous draft."""
        last = self._catch_up(active, taken)
        slots = torch.tensor([r.slot for r in active], device=self.device)
        positions = [p.start + p.count for p in taken]  # where each row's next (chained) entry goes
        chains: list[list[int]] = [[] for _ in active]
        for step in range(max(budgets)):
            logits = self.model.logits(last)
            for row, request in enumerate(active):
                chains[row].append(
                    choose_draft_token(logits[row], request, step < budgets[row], probs, rows[row], step)
                )
            if step + 1 == max(budgets):
                break
            previous = torch.tensor([[chain[-1]] for chain in chains], device=self.device)
            batch = ForwardBatch(
                slots, torch.tensor(positions, device=self.device), torch.ones_like(slots), one_token_each=True
            )
            last = self.head(previous, last[:, None], self.model.embed_tokens, batch, self.caches)[:, 0]
            positions = [p + 1 for p in positions]
        return chains

    def _catch_up(self, active: list[Request], taken: list[_Pending]) -> torch.Tensor:
        """(h_t, token t+1) for every pending position, module by module → each row's last output [b, d]."""
        starts = [p.start for p in taken]
        hiddens = [p.pieces[0] if len(p.pieces) == 1 else torch.cat(p.pieces) for p in taken]
        if len(active) * max(p.count for p in taken) <= self.max_chunk_tokens:
            return self._feed(active, starts, hiddens)
        rows_last = []  # new prompts: one row at a time, in chunks of at most max_chunk_tokens positions
        for request, start, h in zip(active, starts, hiddens):
            for offset in range(0, h.shape[0], self.max_chunk_tokens):
                row_last = self._feed([request], [start + offset], [h[offset : offset + self.max_chunk_tokens]])
            rows_last.append(row_last)
        return torch.cat(rows_last)

    def _feed(self, requests: list[Request], starts: list[int], hiddens: list[torch.Tensor]) -> torch.Tensor:
        """One head forward over (h_t, token t+1) for t = starts[i] … starts[i] + len(hiddens[i]) − 1 per row;
        returns each row's output at its last position [b, d]."""
        counts = [h.shape[0] for h in hiddens]
        token_ids = torch.zeros(len(requests), max(counts), dtype=torch.long)
        hidden = hiddens[0].new_zeros(len(requests), max(counts), hiddens[0].shape[-1])
        for row, (request, start, h) in enumerate(zip(requests, starts, hiddens)):
            token_ids[row, : counts[row]] = torch.tensor(_context(request, start + 1, start + 1 + counts[row]))
            hidden[row, : counts[row]] = h
        num_tokens = torch.tensor(counts, device=self.device)
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        batch = ForwardBatch(slots, torch.tensor(starts, device=self.device), num_tokens)
        out = self.head(token_ids.to(self.device), hidden, self.model.embed_tokens, batch, self.caches)
        return out[torch.arange(len(requests), device=self.device), num_tokens - 1]  # [b, d]

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        """Nothing to shift: the next catch-up rewrites the KV from the accepted positions on."""


def _context(request: Request, begin: int, end: int) -> list[int]:
    """Tokens begin … end-1 of the request's prompt + output, without joining the two lists."""
    prompt = len(request.prompt)
    if begin >= prompt:
        return request.output[begin - prompt : end - prompt]
    return request.prompt[begin:end] + request.output[: max(0, end - prompt)]


@dataclass
class _Pending:
    """Target hidden states of positions start … start+count-1 that the head has not consumed, in the pieces the
    target's forwards produced: joined only when drafted from, so that a plain step appends its row instead of
    copying everything pending."""

    start: int
    pieces: list[torch.Tensor]
    count: int
