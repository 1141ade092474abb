"""Continuous batching over state slots: prefill new requests (in chunks within a token budget), decode (or
speculate) the generating ones, admit within the KV cache's room.

Invariant for every live request: its slot's Mamba states and KV cache cover all of its tokens but the last one,
which is the next model input. A speculative step keeps that invariant through state shifting: it runs
`[last token, d_1 … d_k]`, and keeps the state after input num_accepted_tokens − 1.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Sequence
from operator import attrgetter

import torch

from workers.budget import TokenBudget
from workers.executors import MODULE, build_plan, choose_executor, extra_slots
from workers.model import ForwardBatch, HybridModel, StatePool
from workers.model.kv_blocks import BlockTable
from workers.model.state import DEFAULT_BLOCK_SIZE
from workers.model.steps.cuda_graph import GraphPlan
from workers.model.steps.decode_plan import DecodePlan
from workers.prefix_cache import PrefixCache, PrefixHit
from workers.prefix_sharing import PrefixSharing
from workers.requests import Request
from workers.sampling import sample
from workers.spec_decode.policy import AdaptivePolicy, FixedPolicy, observe_shadow_drafts
from workers.spec_decode.proposal import Proposal, Proposer
from workers.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, num_accepted_tokens
from workers.workspace import Workspace, grown

DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


class Scheduler:
    """Continuous batching over a worker's life: requests are added at any time (`add`), run one `step()` at a time,
    and leave through `take_finished()`. Slots, KV blocks, plans and proposer state are kept between requests."""

    def __init__(
        self,
        model: HybridModel,
        requests: Sequence[Request],
        max_num_seqs: int,
        tokenizer: object | None = None,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        decode_plan: bool = False,
        workspace: Workspace | None = None,
        policy: AdaptivePolicy | FixedPolicy | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        num_kv_blocks: int | None = None,
        cuda_graphs: bool = False,
        num_prefix_checkpoints: int = 0,
    ):
        """`requests`: the first to queue (more come with `add`). `workspace` (an earlier scheduler's `.workspace`) is
        reused when it fits. `policy` decides each step's number of drafts (default: always `num_speculative_tokens`).
        `max_num_batched_tokens` bounds the tokens of every forward (`TokenBudget`); `num_kv_blocks` the KV cache
        (blocks of `DEFAULT_BLOCK_SIZE` positions, the null block included; None: room for every slot's longest
        request). Requests wait for room; one that could never fit finishes with an error. `decode_plan` /
        `cuda_graphs`: execute decode and verification steps through the CPU decode plan / the CUDA graph plan where
        the model allows (`workers/executors.py`). `num_prefix_checkpoints` > 0 turns on prefix caching
        (`workers/prefix_cache.py`, `workers/prefix_sharing.py`) with that many state checkpoints."""
        self.model, self.tokenizer = model, tokenizer
        self.proposer, self.num_speculative_tokens = proposer, num_speculative_tokens if proposer else 0
        self.policy = policy if policy is not None else FixedPolicy()
        self.budget = TokenBudget(max_num_batched_tokens)
        self.rejection_sampler = RejectionSampler()
        self.device = model.embed_tokens.weight.device
        self.max_num_seqs, self.num_kv_blocks = max_num_seqs, num_kv_blocks
        self.num_prefix_checkpoints = num_prefix_checkpoints
        self.mtp = proposer is not None and proposer.drafts_from_hidden
        self.sharing: PrefixSharing | None = None  # made with each workspace
        self.executor = choose_executor(model, decode_plan, cuda_graphs, self.mtp)
        self.workspace = workspace
        self.pool: StatePool | None = None  # set with `plan` and `blocks` for the first requests
        self.plan: DecodePlan | GraphPlan | None = None
        self.blocks: BlockTable | None = None
        self.free_slots: list[int] = []
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully in the state yet (in admission order)
        self.running: list[Request] = []  # generating: every token but the last is in the state
        self.finished: list[Request] = []
        self._retired: set[int] = set()  # request ids retired during this step
        self.num_steps = 0  # steps run, and slots their live requests filled (occupancy = slot steps / steps)
        self.num_slot_steps = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens restored from the prefix cache
        self.add(requests)
        if self.waiting:
            self._fit_workspace()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache of the current workspace (None when prefix caching is off)."""
        return None if self.sharing is None else self.sharing.cache

    def add(self, requests: Sequence[Request]) -> None:
        """Queue requests; they enter free slots in order, from the next step on."""
        self.waiting.extend(requests)

    def take_finished(self) -> list[Request]:
        """The requests that finished since the last call (in the order they finished)."""
        finished, self.finished = self.finished, []
        return finished

    def _fit_workspace(self) -> None:
        """Before admitting into an idle scheduler: slots and KV for what waits, reusing the workspace when it fits,
        else replacing it by one at least as large (the old storage freed first: one workspace at a time)."""
        param = self.model.embed_tokens.weight
        capacity = max(self._positions_needed(r) for r in self.waiting)
        num_slots = max(1, min(self.max_num_seqs, len(self.waiting), self.budget.max_num_batched_tokens))
        max_blocks = 1 + num_slots * math.ceil(capacity / DEFAULT_BLOCK_SIZE)
        num_kv_blocks = self.num_kv_blocks
        num_blocks = max_blocks if num_kv_blocks is None else max(2, min(num_kv_blocks, max_blocks))
        tokens_per_row = self.num_speculative_tokens + 1
        workspace, proposer = self.workspace, self.proposer
        if workspace is None or not workspace.fits(num_slots, capacity, tokens_per_row, self.executor, num_blocks):
            if workspace is not None:
                max_capacity = max(r.max_model_len for r in self.waiting) + self.num_speculative_tokens
                num_slots, capacity, num_blocks = grown(workspace, num_slots, capacity, num_blocks, max_capacity)
                workspace.release()
                if proposer is not None:
                    proposer.release()
            total = num_slots + extra_slots(self.executor)  # the graph plan's null slot: no request ever holds it
            blocks = BlockTable(total, capacity, num_blocks, DEFAULT_BLOCK_SIZE, self.device)
            pool = StatePool(self.model.config, total, capacity, self.device, param.dtype, blocks)
            plan, failure = build_plan(self.executor, self.model, pool, tokens_per_row)
            workspace = Workspace(pool, plan, MODULE if failure else self.executor, failure)
        elif workspace is self.workspace and self.pool is workspace.pool:
            return  # this scheduler's own workspace, as it left it
        self.workspace, self.pool, self.plan = workspace, workspace.pool, workspace.plan
        self.blocks = self.pool.blocks
        self.blocks.reset()
        self.sharing = None
        if self.num_prefix_checkpoints:
            self.sharing = PrefixSharing(self.model, self.pool, self.num_prefix_checkpoints, proposer)
        if proposer is not None:
            proposer.start(self.pool, self.budget.max_num_batched_tokens)
        usable = self.pool.num_slots - extra_slots(workspace.executor)
        self.free_slots = list(range(usable - 1, -1, -1))

    def _positions_needed(self, request: Request) -> int:
        """KV positions a request may use: prompt + max_tokens (within max_model_len) + drafts."""
        length = min(len(request.prompt) + request.params.max_tokens, request.max_model_len)
        return length + self.num_speculative_tokens

    def has_work(self) -> bool:
        """True while any request is waiting, prefilling or running."""
        return bool(self.waiting or self.prefilling or self.running)

    @torch.inference_mode()
    def step(self) -> None:
        """decide (admit within slots and KV room; this step's prefill chunks) → execute (one prefill forward, one
        decode or verification forward of the requests already generating) → apply (retire finished requests)."""
        started = time.perf_counter()
        if self.waiting and not (self.prefilling or self.running):
            self._fit_workspace()
        self._admit()
        self.num_steps += 1
        self.num_slot_steps += len(self.prefilling) + len(self.running)
        chunks = self.budget.prefill_chunks([r.next_prefill_stop() - r.num_computed for r in self.prefilling])
        generating = list(self.running)
        if chunks:
            self._prefill(self.prefilling[: len(chunks)], chunks)
        outcome = None
        if generating:
            if self.proposer is None:
                self._decode(generating)
            else:
                outcome = self._speculate(generating)
        for request in [r for r in self.running if r.finish_reason is not None]:
            self.running.remove(request)
            self._retire(request)
        self._compact()
        if outcome is not None:  # the policy times whole steps (plain steps pay the bookkeeping too); a step that
            # also prefilled, or whose proposer caught up on a prompt, says nothing about the cost of its drafts
            request_ids, asked, accepted, width, timed = outcome
            seconds = time.perf_counter() - started if timed and not chunks else None
            self.policy.observe(request_ids, asked, accepted, seconds, width)
        for request_id in self._retired:  # after the policy learnt from their last step
            self.policy.forget(request_id)
        self._retired.clear()

    def _admit(self) -> None:
        """Waiting requests take free slots in order while their KV room can be reserved."""
        while self.waiting and self.free_slots:
            request = self.waiting[0]
            need = self._positions_needed(request)
            if self.num_kv_blocks is not None and self.blocks.blocks_for(need) > self.num_kv_blocks - 1:
                self.waiting.popleft()
                request.finish_reason = "error"
                request.error = (
                    f"needs {need} KV cache positions (prompt + max_tokens + drafts), more than the KV cache holds "
                    f"({(self.num_kv_blocks - 1) * self.blocks.block_size} positions): raise max_memory / "
                    "gpu_memory_utilization, or lower max_tokens"
                )
                self.finished.append(request)
                continue
            if not self.blocks.can_ever_hold(need):
                return  # longer than this workspace's slots: it grows when the running requests are done
            hit = PrefixHit() if self.sharing is None else self.sharing.lookup(request, self.prefilling)
            if hit is None:
                return  # a request now prefilling is about to checkpoint more of this prompt: wait for it
            shared = hit.chain if self.sharing is None else self.sharing.shared_blocks(hit)
            reserved = self.blocks.try_reserve(need, len(shared), sum(entry.refs == 0 for entry in hit.chain))
            if reserved is None:
                return  # waits until running requests give their room back
            self.waiting.popleft()
            request.slot, request.num_reserved, request.num_reserved_blocks = self.free_slots.pop(), need, reserved
            if self.proposer is not None:
                self.proposer.admit([request])
            if self.sharing is not None:
                self.num_prefix_hit_tokens += self.sharing.start(request, hit, self.waiting, self.prefilling)
            self.prefilling.append(request)

    def _retire(self, request: Request) -> None:
        self._retired.add(request.index)  # the policy forgets it once it has learnt from this step
        if self.sharing is not None:
            self.sharing.release(request)
        self.blocks.free_slot(request.slot)
        self.blocks.release(request.num_reserved_blocks)
        self.free_slots.append(request.slot)
        self.finished.append(request)

    def _compact(self) -> None:
        """Keep live requests in slots 0 … n-1 (in order), so decode reads and updates states as views."""
        live = sorted(self.running + self.prefilling, key=attrgetter("slot"))
        self.free_slots.sort(reverse=True)  # pop() hands out the lowest free slot
        while self.free_slots and live and self.free_slots[-1] < live[-1].slot:
            target, request = self.free_slots.pop(), live.pop()
            self.pool.move(request.slot, target)
            self.blocks.move(request.slot, target)
            if self.proposer is not None:
                self.proposer.move(request.slot, target)
            self.free_slots.append(request.slot)
            self.free_slots.sort(reverse=True)
            request.slot = target
            bisect.insort(live, request, key=attrgetter("slot"))
        self.running.sort(key=attrgetter("slot"))

    def _slots(self, requests: list[Request]) -> torch.Tensor:
        return torch.tensor([r.slot for r in requests], device=self.device)

    def _prefill(self, requests: list[Request], chunks: list[int]) -> None:
        """The next chunk of each request's prompt, continuing its state; prompts that complete sample their
        first token and start generating."""
        starts = [r.num_computed for r in requests]
        input_ids = torch.zeros(len(requests), max(chunks), dtype=torch.long)
        for row, (r, start, n) in enumerate(zip(requests, starts, chunks)):
            input_ids[row, :n] = torch.tensor(r.prompt[start : start + n])
            self.blocks.ensure(r.slot, start + n)
        slots, num_tokens = self._slots(requests), torch.tensor(chunks, device=self.device)
        batch = ForwardBatch(slots, torch.tensor(starts, device=self.device), num_tokens)
        states = None
        if any(starts):  # rows continuing from their states; new rows beside them start from zero states
            states = self.pool.read(slots)
            fresh = [row for row, start in enumerate(starts) if start == 0]
            for state in states:  # copies: zeroing them leaves the slots alone
                state.conv[fresh] = 0
                state.ssm[fresh] = 0
        out = self.model(input_ids.to(self.device), batch, states, self.pool.kv_caches())
        self.pool.write(slots, out.mamba_states)
        self._observe(requests, out.hidden, starts, chunks)
        for r, n in zip(requests, chunks):
            r.num_computed += n
        if self.sharing is not None:
            self.sharing.after_prefill(requests, out.hidden, chunks)
        done = [row for row, r in enumerate(requests) if r.num_computed == len(r.prompt)]
        if done:
            rows = torch.tensor(done, device=self.device)
            last = out.hidden[rows, num_tokens[rows] - 1]
            ready = [requests[row] for row in done]
            self._sample_and_append(ready, self.model.logits(last))
            for request in ready:
                self.prefilling.remove(request)
                if request.finish_reason is None:
                    self.running.append(request)
                else:
                    self._retire(request)

    def _decode(self, requests: list[Request]) -> None:
        """One token for every live request; states are updated in place in their slots."""
        for r in requests:
            self.blocks.ensure(r.slot, r.num_tokens)
        prefix = [r.slot for r in requests] == list(range(len(requests)))  # compacted: views, no copies
        if prefix and self.plan is not None:
            positions = [r.num_tokens - 1 for r in requests]
            logits = self.plan.run([r.last_token for r in requests], positions)
            self._observe_plan(requests, positions, [1] * len(requests))
            self._sample_and_append(requests, logits)
            return
        slots = self._slots(requests)
        input_ids = torch.tensor([[r.last_token] for r in requests], device=self.device)
        cache_lens = torch.tensor([r.num_tokens - 1 for r in requests], device=self.device)
        batch = ForwardBatch(
            slots, cache_lens, torch.ones_like(cache_lens), slots_are_prefix=prefix, one_token_each=True
        )
        states = self.pool.prefix(len(requests)) if prefix else self.pool.read(slots)
        out = self.model(input_ids, batch, states, self.pool.kv_caches(), in_place=True)
        if not prefix:
            self.pool.write(slots, out.mamba_states)
        self._observe(requests, out.hidden, cache_lens.tolist(), [1] * len(requests))
        self._sample_and_append(requests, self.model.logits(out.hidden[:, 0]))

    def _observe(self, requests: list[Request], hidden: torch.Tensor, cache_lens: list[int], kept: list[int]) -> None:
        """Hand the target's final hidden states to a proposer that drafts from them (MTP); others ignore them."""
        if self.mtp:
            self.proposer.observe_target(requests, hidden, cache_lens, kept)

    def _observe_plan(self, requests: list[Request], cache_lens: list[int], kept: list[int]) -> None:
        """`_observe` after a planned step: the CPU decode plan hands out its final hidden states (`choose_executor`
        never picks the graph plan, which does not, for a proposer that drafts from them)."""
        if self.mtp:
            self._observe(requests, self.plan.last_hidden(), cache_lens, kept)

    def _sample_and_append(self, requests: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        for request, token in zip(requests, tokens):
            request.append(token, self.tokenizer)

    def _speculate(self, requests: list[Request]) -> tuple[list[int], list[int], list[int], int, bool]:
        """decide k → propose → verify → accept → shift state, for all live requests at once (k_i may be 0).
        Returns what the policy learns from: request ids, drafts asked for and drafts accepted per request (a draft
        a model proposer could not make counts as rejected), the drafts the verification ran per row (the width
        its time is filed under), and whether the step's time stands for that width (not when the proposer caught
        up on a prompt first)."""
        request_ids = [r.index for r in requests]
        # 1. Decide and propose: never draft past max_tokens or max_model_len; the policy picks k within that.
        max_drafts = self.budget.max_drafts(len(requests), self.num_speculative_tokens)
        budget = [
            max(0, min(max_drafts, r.params.max_tokens - len(r.output) - 1, r.max_model_len - r.num_tokens - 1))
            for r in requests
        ]  # fmt: skip
        # A free proposer (n-gram lookup) drafts before the decision: a row without a match costs nothing whatever
        # k is, so the policy decides over the drafts that exist, and a row that gets none checks its first draft
        # against the token the step produces (a "shadow" draft: acceptance evidence on plain steps).
        free = self.proposer.drafts_cost_nothing and not self.policy.settled_plain(len(requests))
        looked_up = self.proposer.lookup(requests, budget) if free else None
        if looked_up is not None:
            budget = [len(d) for d in looked_up]
        chosen = self.policy.num_drafts(request_ids, budget)
        shadow = {}
        if looked_up is not None:
            shadow = {
                i: (r.num_tokens, d[0]) for i, (r, d, k) in enumerate(zip(requests, looked_up, chosen)) if d and not k
            }
        proposal = None
        if any(chosen):  # else the proposer is not asked
            for r in requests:  # KV room for k + 1 positions (a draft model writes its drafts' KV; padded rows of
                # a planned verification write them all)
                self.blocks.ensure(r.slot, min(r.num_tokens + self.num_speculative_tokens, r.num_reserved))
            if looked_up is not None:
                proposal = Proposal.from_lists([d[:k] for d, k in zip(looked_up, chosen)], None)
            else:
                proposal = self.proposer.propose(requests, chosen)
        if proposal is None or proposal.token_ids.shape[1] == 0:  # a plain step
            self._decode(requests)
            self.proposer.accepted(requests, [1] * len(requests))
            observe_shadow_drafts(self.policy, requests, shadow)
            return request_ids, chosen, [0] * len(requests), 0, proposal is None or not proposal.caught_up
        drafts = proposal.token_ids.to(self.device)  # [num_reqs, max_k]
        num_drafts = torch.tensor(proposal.num_draft_tokens, device=self.device)
        # 2. Verify: the target runs [x_last, d_1 … d_k] per row, keeping its scan inputs for the shift.
        slots = self._slots(requests)
        last = torch.tensor([[r.last_token] for r in requests])
        host_ids = torch.cat([last, proposal.token_ids.clamp_min(0)], dim=1)  # [num_reqs, max_k + 1], on the host
        cache_lens = [r.num_tokens - 1 for r in requests]
        planned = self.plan is not None and [r.slot for r in requests] == list(range(len(requests)))
        if planned:
            logits = self.plan.verify(host_ids.tolist(), cache_lens)
        else:
            old_states = self.pool.read(slots)
            batch = ForwardBatch(slots, torch.tensor(cache_lens, device=self.device), num_drafts + 1)
            out = self.model(host_ids.to(self.device), batch, old_states, self.pool.kv_caches(), keep_scan_inputs=True)
            logits = self.model.logits(out.hidden)
        # 3. Accept: the count of valid tokens drives everything that follows (one device→host copy, the rows).
        output_token_ids = self.rejection_sampler(
            drafts, logits, proposal.probs, [r.params for r in requests], [r.generator for r in requests],
        )  # fmt: skip  # [num_reqs, max_k + 1], on the device
        rows = output_token_ids.tolist()
        accepted = [sum(t != PLACEHOLDER_TOKEN_ID for t in row) for row in rows]  # num_accepted_tokens
        # 4. Shift: keep each layer's state after input num_accepted_tokens − 1; KV length follows the token count.
        if planned:
            self.plan.keep(accepted)
            self._observe_plan(requests, cache_lens, accepted)
        else:
            shifted = self.model.states_after(old_states, out.scan_inputs, num_accepted_tokens(output_token_ids))
            self.pool.write(slots, shifted)
            self._observe(requests, out.hidden, cache_lens, accepted)
        self.proposer.accepted(requests, accepted)
        for request, row, k in zip(requests, rows, proposal.num_draft_tokens):
            request.append_verified(row, k, self.tokenizer)
        observe_shadow_drafts(self.policy, requests, shadow)
        return request_ids, chosen, [n - 1 for n in accepted], drafts.shape[1], not proposal.caught_up
