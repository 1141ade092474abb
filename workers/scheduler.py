"""Continuous batching over state slots. Each step: decide (`schedule`: admit within slots and KV room, this step's
prefill chunks, drafts per generating row) → execute (`workers/executors.py`: one prefill forward, one decode or
verification forward) → apply (`workers/step_apply.py`: sample or accept, shift state, append) → retire.

Invariant for every live request: its slot's Mamba states and KV cache cover all of its tokens but the last one,
which is the next model input. A speculative step keeps that invariant through state shifting: it runs
`[last token, d_1 … d_k]`, and keeps the state after input num_accepted_tokens − 1.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import torch

from workers.config import EngineConfig
from workers.distributed.lockstep import SINGLE_LOCKSTEP, Lockstep, ReplayApplier, fingerprint, without_probs
from workers.executors import MODULE, ModuleExecutor, build_plan, choose_executor, extra_slots, make_executor
from workers.grammar_masks import legal_drafts
from workers.model import HybridModel
from workers.model.kv_blocks import BlockTable
from workers.model.state import DEFAULT_BLOCK_SIZE, StatePool
from workers.request_slots import RequestSlots
from workers.requests import Request
from workers.samples import group_size
from workers.spec_decode.policy import AdaptivePolicy, FixedPolicy
from workers.spec_decode.proposal import Proposal, Proposer
from workers.spec_decode.rejection_sampler import RejectionSampler
from workers.step_apply import StepApplier
from workers.step_plan import DraftPlan, StepOutcome, StepPlan
from workers.workspace import Workspace, grown, workspace_sizes


class Scheduler(RequestSlots):
    """Continuous batching over a worker's life: requests are added at any time (`add`), run one `step()` at a time,
    and leave through `take_finished()`. Slots, KV blocks, plans and proposer state are kept between requests."""

    def __init__(
        self,
        model: HybridModel,
        config: EngineConfig,
        requests: Sequence[Request] = (),
        proposer: Proposer | None = None,
        policy: AdaptivePolicy | FixedPolicy | None = None,
        tokenizer: Any | None = None,
        num_kv_blocks: int | None = None,
        num_prefix_checkpoints: int = 0,
        workspace: Workspace | None = None,
        lockstep: Lockstep = SINGLE_LOCKSTEP,
    ):
        """`config` sizes the batch (`scheduler`), picks the executor (`execution`) and bounds the drafts
        (`speculative`, used with `proposer`). `policy` decides each step's number of drafts (default: always
        num_speculative_tokens). `num_kv_blocks` bounds the KV cache (blocks of `DEFAULT_BLOCK_SIZE` positions, the
        null block included; None: room for every slot's longest request); requests wait for room, and one that
        could never fit finishes with an error. `num_prefix_checkpoints` > 0 turns on prefix caching
        (`workers/prefix_sharing.py`). `workspace` (an earlier scheduler's `.workspace`) is reused when it fits.
        `lockstep`: this rank's place in a tensor-parallel group (`workers/distributed/lockstep.py`): the leader
        decides the executor, the drafts and the tokens, the followers replay them."""
        execution = config.execution
        k = config.num_speculative_tokens if proposer else 0
        policy = policy if policy is not None else FixedPolicy()
        super().__init__(model, config.scheduler, proposer, k, num_kv_blocks, num_prefix_checkpoints)
        self.tokenizer, self.policy, self.lockstep = tokenizer, policy, lockstep
        self.executor_kind = lockstep.decide(
            "executor", lambda: choose_executor(model, execution.decode_plan, bool(execution.cuda_graphs), self.mtp)
        )
        mode = config.sampler.logprobs_mode
        if lockstep.follows:
            self.apply = ReplayApplier(proposer, lockstep, mode)
        else:
            publish = lockstep.publish if lockstep.leads else None
            self.apply = StepApplier(tokenizer, proposer, policy, RejectionSampler(), mode, publish)
        self.workspace = workspace
        self.executor: ModuleExecutor | None = None  # set with each workspace
        self.add(requests)
        if self.waiting:
            self._fit_workspace()

    @property
    def plan(self) -> Any:
        """The current workspace's decode plan (None: module by module)."""
        return None if self.workspace is None else self.workspace.plan

    def _fit_workspace(self) -> None:
        """Before admitting into an idle scheduler: slots and KV for what waits, reusing the workspace when it fits,
        else replacing it by one at least as large (the old storage freed first: one workspace at a time)."""
        num_slots, capacity, num_blocks = workspace_sizes(
            [self._positions_needed(r) for r in self.waiting for _ in range(group_size(r))],
            self.config.max_num_seqs,
            self.budget.max_num_batched_tokens,
            self.num_kv_blocks,
            DEFAULT_BLOCK_SIZE,
        )
        tokens_per_row = self.num_speculative_tokens + 1
        workspace, proposer, kind = self.workspace, self.proposer, self.executor_kind
        if workspace is None or not workspace.fits(num_slots, capacity, tokens_per_row, kind, num_blocks):
            if workspace is not None:
                max_capacity = max(r.max_model_len for r in self.waiting) + self.num_speculative_tokens
                num_slots, capacity, num_blocks = grown(workspace, num_slots, capacity, num_blocks, max_capacity)
                workspace.release()
                if proposer is not None:
                    proposer.release()
            total = num_slots + extra_slots(kind)  # the graph plan's null slot: no request ever holds it
            blocks = BlockTable(total, capacity, num_blocks, DEFAULT_BLOCK_SIZE, self.device)
            param = self.model.embed_tokens.weight
            pool = StatePool(self.model.config, total, capacity, self.device, param.dtype, blocks)
            plan, failure = build_plan(kind, self.model, pool, tokens_per_row)
            failure = self.lockstep.agree_failure(failure)  # one rank's failed capture: every rank runs eagerly
            plan = None if failure else plan
            workspace = Workspace(pool, plan, MODULE if failure else kind, failure)
        elif workspace is self.workspace and self.pool is workspace.pool:
            return  # this scheduler's own workspace, as it left it
        self.workspace = workspace
        self.executor = make_executor(self.model, workspace.pool, workspace.plan, self.mtp)
        self.start(workspace.pool, workspace.pool.num_slots - extra_slots(workspace.executor))

    @torch.inference_mode()
    def step(self) -> None:
        """decide → execute → apply (see the module docstring), then retire finished requests."""
        started = time.perf_counter()
        plan = self.schedule()
        if plan.prefill:
            self.num_prefill_tokens += sum(plan.chunks)
            hidden = self.executor.prefill(plan.prefill, plan.chunks)
            self._apply_prefill(plan.prefill, plan.chunks, hidden)
        outcome = self._run_generating(plan) if plan.generating else None
        for request in [r for r in self.running if r.finish_reason is not None]:
            self.running.remove(request)
            self.retire(request)
        self.compact()
        if outcome is not None:  # the policy times whole steps (plain steps pay the bookkeeping too); a step that
            # also prefilled, or whose proposer caught up on a prompt, says nothing about the cost of its drafts
            seconds = time.perf_counter() - started if outcome.timed and not plan.chunks else None
            self.policy.observe(
                outcome.request_ids, outcome.num_drafts, outcome.num_accepted_drafts, seconds, outcome.width
            )
        for request_id in self.retired:  # after the policy learnt from their last step
            self.policy.forget(request_id)
        self.retired.clear()

    def schedule(self) -> StepPlan:
        """Decide the step: admit, pick the prefill chunks within the token budget, and the drafts per row."""
        if self.waiting and not (self.prefilling or self.running):
            self._fit_workspace()
        self._admit()
        self.num_steps += 1
        self.num_slot_steps += len(self.prefilling) + len(self.running)
        chunks = self.budget.prefill_chunks([r.next_prefill_stop() - r.num_computed for r in self.prefilling])
        generating = list(self.running)
        drafts = self.lockstep.decide(
            "drafts",
            lambda: self._decide_drafts(generating) if generating and self.proposer is not None else None,
            fingerprint=lambda: fingerprint(self.prefilling + self.running),
        )
        return StepPlan(self.prefilling[: len(chunks)], chunks, generating, drafts)

    def _decide_drafts(self, requests: list[Request]) -> DraftPlan:
        """Never draft past max_tokens or max_model_len; the policy picks k within that. A free proposer (n-gram
        lookup) drafts before the decision: a row without a match costs nothing whatever k is, so the policy
        decides over the drafts that exist, and a row that gets none checks its first draft against the token the
        step produces (a "shadow" draft)."""
        max_drafts = self.budget.max_drafts(len(requests), self.num_speculative_tokens)
        budget = [
            max(0, min(max_drafts, r.params.max_tokens - len(r.output) - 1, r.max_model_len - r.num_tokens - 1))
            for r in requests
        ]
        free = self.proposer.drafts_cost_nothing and not self.policy.settled_plain(len(requests))
        looked_up = self.proposer.lookup(requests, budget) if free else None
        if looked_up is not None:
            budget = [len(d) for d in looked_up]
        chosen = self.policy.num_drafts([r.index for r in requests], budget)
        shadow = {}
        if looked_up is not None:
            rows = zip(requests, looked_up, chosen)
            shadow = {i: (r.num_tokens, d[0]) for i, (r, d, k) in enumerate(rows) if d and not k}
        return DraftPlan(chosen, looked_up, shadow)

    def _apply_prefill(self, requests: list[Request], chunks: list[int], hidden: torch.Tensor) -> None:
        """After a prefill forward: the proposer and the prefix cache see it; prompts that complete sample their
        first token and start generating."""
        self.apply.observe(requests, hidden, [r.num_computed for r in requests], chunks)
        for r, n in zip(requests, chunks):
            r.num_computed += n
        if self.sharing is not None:
            self.sharing.after_prefill(requests, hidden, chunks)
        done = [row for row, r in enumerate(requests) if r.num_computed == len(r.prompt)]
        if done:
            rows = torch.tensor(done, device=self.device)
            num_tokens = torch.tensor(chunks, device=self.device)
            ready, logits_rows = [], []  # each prompt's samples draw from its last logits (`workers/samples.py`)
            for i, row in enumerate(done):
                samples = [requests[row]] + (self.fork(requests[row]) if requests[row].group is not None else [])
                ready += samples
                logits_rows += [i] * len(samples)
                self.prefilling.remove(requests[row])
            logits = self.model.logits(hidden[rows, num_tokens[rows] - 1])
            self.apply.sampled(ready, logits[torch.tensor(logits_rows, device=self.device)])
            for request in ready:
                if request.finish_reason is None:
                    self.running.append(request)
                else:
                    self.retire(request)

    def _run_generating(self, plan: StepPlan) -> StepOutcome | None:
        """Execute and apply the generating rows' step: a plain decode, or propose → verify → accept → shift."""
        requests, drafts = plan.generating, plan.drafts
        if drafts is None:
            self.apply.decoded(requests, *self.executor.decode(requests))
            return None
        proposal = None
        if any(drafts.num_drafts):  # else not asked; structured outputs: only drafts the grammar allows are verified
            self._reserve_drafts(requests)
            replay = None  # followers of an MTP head run it too: its forward holds collectives
            if drafts.looked_up is None and self.proposer.drafts_from_hidden:
                replay = functools.partial(self.proposer.propose, requests, drafts.num_drafts)
            proposal = self.lockstep.decide(
                "proposal", lambda: legal_drafts(requests, self._propose(requests, drafts)), None, replay, without_probs
            )
        request_ids = [r.index for r in requests]
        if proposal is None or proposal.token_ids.shape[1] == 0:  # a plain step
            self.apply.decoded(requests, *self.executor.decode(requests))
            self.proposer.accepted(requests, [1] * len(requests))
            self.apply.shadow_drafts(requests, drafts.shadow)
            timed = proposal is None or not proposal.caught_up
            return StepOutcome(request_ids, drafts.num_drafts, [0] * len(requests), 0, timed)
        # Verify: the target runs [x_last, d_1 … d_k] per row (the host ids: no device→host copy).
        last = torch.tensor([[r.last_token] for r in requests])
        host_ids = torch.cat([last, proposal.token_ids.clamp_min(0)], dim=1)  # [num_reqs, max_k + 1]
        num_drafts = torch.tensor(proposal.num_draft_tokens, device=self.device)
        verification = self.executor.verify(requests, host_ids, num_drafts)
        accepted = self.apply.verified(requests, proposal, verification, self.executor)
        self.apply.shadow_drafts(requests, drafts.shadow)
        width = proposal.token_ids.shape[1]
        return StepOutcome(request_ids, drafts.num_drafts, [n - 1 for n in accepted], width, not proposal.caught_up)

    def _reserve_drafts(self, requests: list[Request]) -> None:
        """KV room for k + 1 positions before drafting (a draft model writes its drafts' KV; padded rows of a
        planned verification write them all); on every rank, so the block tables stay alike."""
        for r in requests:
            self.blocks.ensure(r.slot, min(r.num_tokens + self.num_speculative_tokens, r.num_reserved))

    def _propose(self, requests: list[Request], drafts: DraftPlan) -> Proposal:
        """The step's drafts: the looked-up ones cut to the decision, or the proposer's."""
        if drafts.looked_up is not None:
            return Proposal.from_lists([d[:k] for d, k in zip(drafts.looked_up, drafts.num_drafts)], None)
        return self.proposer.propose(requests, drafts.num_drafts)
