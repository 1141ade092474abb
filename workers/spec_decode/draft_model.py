"""Draft-model proposer for attention-only *and hybrid* draft models.

The draft keeps its own per-slot state. Invariant: the draft state of a request covers its first `covered`
tokens; each proposal first feeds the tokens it has not seen (at least the newest one), then drafts one token
per step. After verification the draft keeps, per request, the state after the last draft it fed that the target
accepted — the same count-based state shifting as the target, applied to the draft's own recurrent layers —
and remembers the rest (the recovered/bonus token, and d_k when all were accepted) as unseen.

A CPU float32 draft runs its steps through a decode plan; when every row is greedy the steps that feed one token
per row run as one native chain (`workers/model/steps/draft_chain.py`), and the planned steps' states for the shift are
snapshotted into preallocated buffers. The pool, plan and chain are kept across runs that share the target's
block table (the scheduler reuses its workspace), so a new `generate` call does not re-record them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model import ForwardBatch, HybridModel, MambaState, StatePool
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason
from workers.model.steps.draft_chain import DraftChain
from workers.requests import Request
from workers.spec_decode.proposal import Proposal, Proposer, choose_draft_token, empty_draft_probs


@dataclass
class PendingShift:
    """What the last proposal ran, until `accepted` shifts the draft's states."""

    requests: list[Request]  # the rows that ran the draft
    context_lens: list[int]  # tokens of each request before its drafts
    budgets: list[int]  # drafts asked of each row
    num_steps: int  # draft steps run (the largest budget)
    states_by_step: list[list[MambaState]] | None  # the module path's states after each step (None: planned,
    # the states are in the pool and the chain's snapshots)


class DraftModelProposer(Proposer):
    """Proposes k tokens per request with a smaller model that shares the target's vocabulary."""

    needs_draft_model = True

    def __init__(
        self, model: HybridModel, num_speculative_tokens: int = 1, decode_plan: bool = False, native_chain: bool = True
    ):
        """`decode_plan`: run the draft's steps as decode plans where its model allows (same results, faster).
        `native_chain`: with plans, run the steps of all-greedy proposals as one native chain (False: one plan step
        at a time; the same drafts and states)."""
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.num_speculative_tokens = num_speculative_tokens
        self.pool: StatePool | None = None
        self.plan: DecodePlan | None = None
        self.chain: DraftChain | None = None
        self.native_chain = native_chain
        self._plan_tokens = num_speculative_tokens + 1 if decode_plan and unsupported_reason(model) is None else 0
        self.max_chunk_tokens = 2048  # set by `start` to the scheduler's token budget
        self.covered: dict[int, int] = {}  # slot → tokens the draft state has consumed
        self._pending_shift: PendingShift | None = None

    def start(self, pool: StatePool, max_chunk_tokens: int) -> None:
        """Draft state slots for the target's `pool` (same slot ids; KV paged over the target's blocks): the ones of
        the previous run when they were paged over the same block table (a reused workspace), else new ones."""
        self.max_chunk_tokens = max_chunk_tokens
        self._pending_shift = None
        self.covered.clear()
        if self.pool is not None and self.pool.blocks is pool.blocks and self._fits(pool):
            return
        dtype = self.model.embed_tokens.weight.dtype
        self.pool = StatePool(self.model.config, pool.num_slots, pool.capacity, self.device, dtype, pool.blocks)
        self.plan = DecodePlan(self.model, self.pool, self._plan_tokens) if self._plan_tokens else None
        self.chain = DraftChain(self.plan, self.num_speculative_tokens) if self.plan is not None else None

    def release(self) -> None:
        """Free the draft's state slots and plans now (the target's workspace is being replaced by a larger one)."""
        if self.pool is not None:
            self.pool.release()
        self.pool, self.plan, self.chain = None, None, None

    def _fits(self, pool: StatePool) -> bool:
        """Whether the draft's pool covers every slot and position of the target's `pool`."""
        return self.pool.num_slots >= pool.num_slots and self.pool.capacity >= pool.capacity

    def move(self, source: int, target: int) -> None:
        """Follow a request to its new slot (its KV blocks move with the target's block table)."""
        self.pool.move(source, target)
        self.covered[target] = self.covered.pop(source)

    def admit(self, requests: list[Request]) -> None:
        """New requests start from an empty draft state."""
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        self.pool.write(slots, self.pool.zeros(len(requests)))
        self.covered.update({r.slot: 0 for r in requests})

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        """k_i = num_drafts[i] draft tokens per request (rows with 0 do not run the draft)."""
        rows = [i for i, k in enumerate(num_drafts) if k > 0]
        drafts: list[list[int]] = [[] for _ in requests]
        if not rows:
            return Proposal.from_lists(drafts, None)
        active = [requests[i] for i in rows]
        budgets = [num_drafts[i] for i in rows]
        caught_up = max(r.num_tokens - self.covered[r.slot] for r in active) > self.num_speculative_tokens + 1
        self._catch_up(active)
        sampled = any(not r.params.greedy for r in active)
        probs = empty_draft_probs(len(requests), max(budgets), self.model.config.vocab_size, sampled, self.device)
        # Step 0 feeds every unseen token; steps 1 … k-1 feed the previous draft.
        cache_lens = [self.covered[r.slot] for r in active]
        unseen = [_tokens_from(r, c) for r, c in zip(active, cache_lens)]
        planned = (
            self.plan is not None
            and max(budgets) <= self.chain.max_steps
            and all(r.slot == row for row, r in enumerate(active))
        )
        states_by_step = None
        # Constrained rows draft step by step, each draft from the grammar-masked logits: the fused chain's
        # unmasked drafts, cut at the first illegal one, kept ~3x fewer accepted drafts (docs/speculative-decoding.md).
        constrained = any(r.grammar is not None for r in active)
        if planned and self.native_chain and not sampled and not constrained:
            chains = self._greedy_chain(unseen, cache_lens, max(budgets))
        else:
            chains, states_by_step = self._step_by_step(active, rows, budgets, unseen, cache_lens, planned, probs)
        for row, i in enumerate(rows):
            drafts[i] = chains[row][: budgets[row]]
        context_lens = [r.num_tokens for r in active]
        self._pending_shift = PendingShift(active, context_lens, budgets, max(budgets), states_by_step)
        return Proposal.from_lists(drafts, probs, caught_up)

    def _greedy_chain(self, unseen: list[list[int]], cache_lens: list[int], num_steps: int) -> list[list[int]]:
        """All rows greedy and planned: the chain of `num_steps` steps per row (the argmax of each), the one-token
        steps as one native call; states left as `_step_by_step` leaves a planned run's."""
        if all(len(tokens) == 1 for tokens in unseen):
            return self.chain.run([tokens[0] for tokens in unseen], cache_lens, 0, num_steps).t().tolist()
        lengths = [len(tokens) for tokens in unseen]
        first = self._pool_step(unseen, lengths, cache_lens).argmax(-1)  # [b]
        if num_steps == 1:
            return first[:, None].tolist()
        self.chain.snapshot(0, len(unseen))
        positions = [c + n for c, n in zip(cache_lens, lengths)]
        rest = self.chain.run(first.tolist(), positions, 1, num_steps)  # [num_steps - 1, b]
        return torch.cat([first[None], rest]).t().tolist()

    def _step_by_step(
        self,
        active: list[Request],
        rows: list[int],
        budgets: list[int],
        unseen: list[list[int]],
        cache_lens: list[int],
        planned: bool,
        probs: torch.Tensor | None,
    ) -> tuple[list[list[int]], list[list[MambaState]] | None]:
        """The draft steps one by one (any sampling): the tokens each row drew, and the module path's states after
        each step (None when planned: the pool holds the last step's, the chain's snapshots the others)."""
        num_steps = max(budgets)
        slots = torch.tensor([r.slot for r in active], device=self.device)
        states, states_by_step = None if planned else self.pool.read(slots), []  # planned steps read the pool
        chains: list[list[int]] = [[] for _ in active]  # tokens fed to the draft after `unseen`
        for step in range(num_steps):
            inputs = unseen if step == 0 else [[chain[-1]] for chain in chains]
            lengths = [len(t) for t in inputs]
            if planned:
                logits = self._pool_step(inputs, lengths, cache_lens)
                if step < num_steps - 1:
                    self.chain.snapshot(step, len(active))
            else:
                logits, states = self._module_step(inputs, lengths, cache_lens, slots, states)
                states_by_step.append(states)
            cache_lens = [c + n for c, n in zip(cache_lens, lengths)]
            for row, request in enumerate(active):
                chains[row].append(
                    choose_draft_token(logits[row], request, step < budgets[row], probs, rows[row], step)
                )
        return chains, None if planned else states_by_step

    def _catch_up(self, active: list[Request]) -> None:
        """When the first draft step would feed more than `max_chunk_tokens` (padded) tokens — new prompts — feed
        every row's unseen tokens but the newest first, one row at a time in chunks of at most that many."""
        unseen = [r.num_tokens - self.covered[r.slot] for r in active]
        if len(active) * max(unseen) <= self.max_chunk_tokens:
            return
        for request in active:
            self._consume(request, request.num_tokens - 1)

    def _consume(self, request: Request, end: int) -> None:
        """Feed the draft the request's tokens from what it covers up to position `end` (exclusive), in chunks of
        at most `max_chunk_tokens`."""
        context = request.prompt + request.output
        slots = torch.tensor([request.slot], device=self.device)
        while self.covered[request.slot] < end:
            start = self.covered[request.slot]
            piece = context[start : min(end, start + self.max_chunk_tokens)]
            _, states = self._module_step([piece], [len(piece)], [start], slots, self.pool.read(slots))
            self.pool.write(slots, states)
            self.covered[request.slot] = start + len(piece)

    @torch.inference_mode()
    def prepare_fork(self, source: Request) -> None:
        """The draft prefills the whole prompt once, for all of its samples."""
        self._consume(source, source.num_tokens)

    def fork(self, source: Request, targets: list[Request]) -> None:
        """Each sample starts from a copy of the draft's states of the prompt (its KV follows the target's blocks)."""
        for target in targets:
            self.pool.move(source.slot, target.slot)
            self.covered[target.slot] = self.covered[source.slot]

    def _module_step(
        self,
        inputs: list[list[int]],
        lengths: list[int],
        cache_lens: list[int],
        slots: torch.Tensor,
        states: list[MambaState],
    ) -> tuple[torch.Tensor, list[MambaState]]:
        """One draft forward module by module from `states` → (logits [b, v] after each row's last input, new states)."""
        input_ids = torch.zeros(len(inputs), max(lengths), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
        num_tokens = torch.tensor(lengths, device=self.device)
        batch = ForwardBatch(
            slots, torch.tensor(cache_lens, device=self.device), num_tokens, one_token_each=all(n == 1 for n in lengths)
        )
        out = self.model(input_ids.to(self.device), batch, states, self.pool.kv_caches())
        last = out.hidden[torch.arange(len(inputs), device=self.device), num_tokens - 1]
        return self.model.logits(last), out.mamba_states

    def _pool_step(self, inputs: list[list[int]], lengths: list[int], cache_lens: list[int]) -> torch.Tensor:
        """One draft step of rows 0 … b-1 (slots 0 … b-1) from the pool's states, left in the pool: through the
        decode plan when the rows fit it (short rows padded, then each row's states shifted back to its own last
        input), else module by module. Returns the logits [b, v] after each row's last input (a copy)."""
        b, width = len(inputs), max(lengths)
        if width > self.plan.tokens_per_row:  # a long unseen run (the draft skipped steps): the module path
            slots = torch.arange(b, device=self.device)
            logits, states = self._module_step(inputs, lengths, cache_lens, slots, self.pool.read(slots))
            self.pool.write(slots, states)
            return logits
        if width == 1:
            return self.plan.run([tokens[0] for tokens in inputs], cache_lens).clone()
        logits = self.plan.verify([tokens + [0] * (width - len(tokens)) for tokens in inputs], cache_lens)
        self.plan.keep(lengths)
        return logits[torch.arange(b), torch.tensor(lengths) - 1]

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        """Keep each request's draft state after its last accepted draft (the draft-side state shift)."""
        pending, self._pending_shift = self._pending_shift, None
        if pending is None:
            return
        accepted_by_request = {id(r): n for r, n in zip(requests, num_accepted)}
        # State j covers the context + d_1 … d_j; keep j = accepted drafts, capped by the drafts actually fed.
        keep = [min(accepted_by_request[id(r)] - 1, k - 1) for r, k in zip(pending.requests, pending.budgets)]
        if pending.states_by_step is None:
            self.chain.keep(keep, pending.num_steps)
        else:
            self._keep_module_states(pending.requests, pending.states_by_step, keep)
        for request, context_len, j in zip(pending.requests, pending.context_lens, keep):
            self.covered[request.slot] = context_len + j

    def _keep_module_states(
        self, active: list[Request], states_by_step: list[list[MambaState]], keep: list[int]
    ) -> None:
        """Write each row's states after step keep[row] (of the module path's per-step states) into its slot."""
        keep_index = torch.tensor(keep, device=self.device)
        rows = torch.arange(len(active), device=self.device)
        selected = []
        for layer in range(len(states_by_step[0])):
            conv = torch.stack([s[layer].conv for s in states_by_step])[keep_index, rows]
            ssm = torch.stack([s[layer].ssm for s in states_by_step])[keep_index, rows]
            selected.append(MambaState(conv, ssm))
        self.pool.write(torch.tensor([r.slot for r in active], device=self.device), selected)


def _tokens_from(request: Request, start: int) -> list[int]:
    """The request's tokens (prompt + output) from position `start` on, without joining the whole context."""
    n = len(request.prompt)
    return request.output[start - n :] if start >= n else request.prompt[start:] + request.output
