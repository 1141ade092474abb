"""Draft-model proposer for attention-only *and hybrid* draft models.

The draft keeps its own per-slot state. Invariant: the draft state of a request covers its first `covered`
tokens; each proposal first feeds the tokens it has not seen (at least the newest one), then drafts one token
per step. After verification the draft keeps, per request, the state after the last draft it fed that the target
accepted — the same count-based state shifting as the target, applied to the draft's own recurrent layers —
and remembers the rest (the recovered/bonus token, and d_k when all were accepted) as unseen.
"""

from __future__ import annotations

import torch

from workers.model import ForwardBatch, HybridModel, MambaState, StatePool
from workers.model.decode_plan import DecodePlan, unsupported_reason
from workers.requests import Request
from workers.spec_decode.proposal import Proposal, choose_draft_token, empty_draft_probs


class DraftModelProposer:
    """Proposes k tokens per request with a smaller model that shares the target's vocabulary."""

    def __init__(self, model: HybridModel, num_speculative_tokens: int = 1, decode_plan: bool = False):
        """`decode_plan`: run the draft's steps as decode plans where its model allows (same results, faster)."""
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.pool: StatePool | None = None
        self.plan: DecodePlan | None = None
        self._plan_tokens = num_speculative_tokens + 1 if decode_plan and unsupported_reason(model) is None else 0
        self.max_chunk_tokens = 2048  # set by `start` to the scheduler's token budget
        self.covered: dict[int, int] = {}  # slot → tokens the draft state has consumed
        self._pending_shift: tuple[list[Request], list[list[MambaState]], list[int], list[int]] | None = None

    def start(self, pool: StatePool, max_chunk_tokens: int) -> None:
        """Allocate the draft's state slots (same slot ids as the target's; KV paged over the target's blocks)."""
        dtype = self.model.embed_tokens.weight.dtype
        self.pool = StatePool(self.model.config, pool.num_slots, pool.capacity, self.device, dtype, pool.blocks)
        self.max_chunk_tokens = max_chunk_tokens
        self.plan = DecodePlan(self.model, self.pool, self._plan_tokens) if self._plan_tokens else None

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
        contexts = [r.prompt + r.output for r in active]
        self._catch_up(active, contexts)
        slots = torch.tensor([r.slot for r in active], device=self.device)
        sampled = any(not r.params.greedy for r in active)
        probs = empty_draft_probs(len(requests), max(budgets), self.model.config.vocab_size, sampled, self.device)
        # Step 0 feeds every unseen token; steps 1 … k-1 feed the previous draft.
        unseen = [ctx[self.covered[r.slot] :] for r, ctx in zip(active, contexts)]
        cache_lens = [self.covered[r.slot] for r in active]
        planned = self.plan is not None and [r.slot for r in active] == list(range(len(active)))
        states, states_by_step = None if planned else self.pool.read(slots), []  # planned steps read the pool
        chains: list[list[int]] = [[] for _ in active]  # tokens fed to the draft after `unseen`
        for step in range(max(budgets)):
            inputs = unseen if step == 0 else [[chain[-1]] for chain in chains]
            lengths = [len(t) for t in inputs]
            if planned and max(lengths) <= self.plan.tokens_per_row:
                logits, states = self._planned_step(inputs, lengths, cache_lens)
            else:
                states = self.pool.read(slots) if states is None else states
                logits, states = self._module_step(inputs, lengths, cache_lens, slots, states)
                if planned:  # planned steps read the pool: give it this step's states
                    self.pool.write(slots, states)
            states_by_step.append(states)
            cache_lens = [c + n for c, n in zip(cache_lens, lengths)]
            for row, request in enumerate(active):
                chains[row].append(
                    choose_draft_token(logits[row], request, step < budgets[row], probs, rows[row], step)
                )
        for row, i in enumerate(rows):
            drafts[i] = chains[row][: budgets[row]]
        self._pending_shift = (active, states_by_step, [len(c) for c in contexts], budgets)
        return Proposal.from_lists(drafts, probs)

    def _catch_up(self, active: list[Request], contexts: list[list[int]]) -> None:
        """When the first draft step would feed more than `max_chunk_tokens` (padded) tokens — new prompts — feed
        every row's unseen tokens but the newest first, one row at a time in chunks of at most that many."""
        unseen = [len(ctx) - self.covered[r.slot] for r, ctx in zip(active, contexts)]
        if len(active) * max(unseen) <= self.max_chunk_tokens:
            return
        for request, context in zip(active, contexts):
            slots = torch.tensor([request.slot], device=self.device)
            while self.covered[request.slot] < len(context) - 1:
                start = self.covered[request.slot]
                piece = context[start : min(len(context) - 1, start + self.max_chunk_tokens)]
                _, states = self._module_step([piece], [len(piece)], [start], slots, self.pool.read(slots))
                self.pool.write(slots, states)
                self.covered[request.slot] = start + len(piece)

    def _module_step(
        self, inputs: list[list[int]], lengths: list[int], cache_lens: list[int], slots: torch.Tensor,
        states: list[MambaState],
    ) -> tuple[torch.Tensor, list[MambaState]]:  # fmt: skip
        """One draft forward module by module from `states` → (logits [b, v] after each row's last input, new states)."""
        input_ids = torch.zeros(len(inputs), max(lengths), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
        num_tokens = torch.tensor(lengths, device=self.device)
        batch = ForwardBatch(slots, torch.tensor(cache_lens, device=self.device), num_tokens,
                             one_token_each=all(n == 1 for n in lengths))  # fmt: skip
        out = self.model(input_ids.to(self.device), batch, states, self.pool.kv_caches())
        last = out.hidden[torch.arange(len(inputs), device=self.device), num_tokens - 1]
        return self.model.logits(last), out.mamba_states

    def _planned_step(
        self, inputs: list[list[int]], lengths: list[int], cache_lens: list[int]
    ) -> tuple[torch.Tensor, list[MambaState]]:
        """The same step through the draft's decode plan on slots 0 … b-1, in place (short rows padded, then each
        row's states shifted back to its own last input); returns copies of the states for the draft's shift."""
        b, width = len(inputs), max(lengths)
        if width == 1:
            logits = self.plan.run([tokens[0] for tokens in inputs], cache_lens)
        else:
            logits = self.plan.verify([tokens + [0] * (width - len(tokens)) for tokens in inputs], cache_lens)
            self.plan.keep(lengths)
            logits = logits[torch.arange(b), torch.tensor(lengths) - 1]
        num_layers = self.pool.conv.shape[0]
        states = [MambaState(self.pool.conv[i, :b].clone(), self.pool.ssm[i, :b].clone()) for i in range(num_layers)]
        return logits.clone(), states

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        """Keep each request's draft state after its last accepted draft (the draft-side state shift)."""
        if self._pending_shift is None:
            return
        active, states_by_step, context_lens, budgets = self._pending_shift
        self._pending_shift = None
        accepted_by_request = {id(r): n for r, n in zip(requests, num_accepted)}
        # State j covers the context + d_1 … d_j; keep j = accepted drafts, capped by the drafts actually fed.
        keep = [min(accepted_by_request[id(r)] - 1, k - 1) for r, k in zip(active, budgets)]
        keep_index = torch.tensor(keep, device=self.device)
        rows = torch.arange(len(active), device=self.device)
        selected = []
        for layer in range(len(states_by_step[0])):
            conv = torch.stack([s[layer].conv for s in states_by_step])[keep_index, rows]
            ssm = torch.stack([s[layer].ssm for s in states_by_step])[keep_index, rows]
            selected.append(MambaState(conv, ssm))
        self.pool.write(torch.tensor([r.slot for r in active], device=self.device), selected)
        for request, context_len, j in zip(active, context_lens, keep):
            self.covered[request.slot] = context_len + j
