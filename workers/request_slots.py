"""Which requests hold which state slots: the queues, admission within slots and KV room, retiring, compaction.
The scheduler (`workers/scheduler.py`) builds its steps on it."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from operator import attrgetter

from workers.budget import TokenBudget
from workers.config import SchedulerConfig
from workers.model import HybridModel, StatePool
from workers.model.kv_blocks import BlockTable
from workers.prefix_cache import PrefixCache, PrefixHit
from workers.prefix_sharing import PrefixSharing
from workers.requests import Request
from workers.samples import fork_reservation, fork_samples, group_size, leave_group
from workers.spec_decode.proposal import Proposer


class RequestSlots:
    """The requests of a scheduler — waiting, prefilling (admitted, prompt not fully in the state), running
    (generating: every token but the last is in the state), finished — and the slots and KV blocks they hold."""

    def __init__(
        self,
        model: HybridModel,
        config: SchedulerConfig,
        proposer: Proposer | None,
        num_speculative_tokens: int,
        num_kv_blocks: int | None,
        num_prefix_checkpoints: int,
    ):
        self.model, self.config = model, config
        self.proposer, self.num_speculative_tokens = proposer, num_speculative_tokens
        self.mtp = proposer is not None and proposer.drafts_from_hidden  # drafts from the target's hidden states
        self.budget = TokenBudget(config.max_num_batched_tokens)
        self.device = model.embed_tokens.weight.device
        self.num_kv_blocks, self.num_prefix_checkpoints = num_kv_blocks, num_prefix_checkpoints
        self.sharing: PrefixSharing | None = None  # made with each workspace
        self.pool: StatePool | None = None  # set with `blocks` for the first requests
        self.blocks: BlockTable | None = None
        self.free_slots: list[int] = []
        self.num_promised_slots = 0  # free slots the admitted prompts' forks will take (`workers/samples.py`)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # in admission order
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.retired: set[int] = set()  # request ids retired during this step
        self.num_steps = 0  # steps run, and slots their live requests filled (occupancy = slot steps / steps)
        self.num_slot_steps = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens restored from the prefix cache
        self.num_prefill_tokens = 0  # prompt tokens computed (prefill forwards; a fork computes none)

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

    def has_work(self) -> bool:
        """True while any request is waiting, prefilling or running."""
        return bool(self.waiting or self.prefilling or self.running)

    def _positions_needed(self, request: Request) -> int:
        """KV positions a request may use: prompt + max_tokens (within max_model_len) + drafts."""
        length = min(len(request.prompt) + request.params.max_tokens, request.max_model_len)
        return length + self.num_speculative_tokens

    def start(self, pool: StatePool, num_usable_slots: int) -> None:
        """Serve the next requests from `pool` (its first `num_usable_slots` slots), all of them free."""
        self.pool, self.blocks = pool, pool.blocks
        self.blocks.reset()
        self.sharing = None
        if self.num_prefix_checkpoints:
            self.sharing = PrefixSharing(self.model, pool, self.num_prefix_checkpoints, self.proposer)
        if self.proposer is not None:
            self.proposer.start(pool, self.budget.max_num_batched_tokens)
        self.free_slots = list(range(num_usable_slots - 1, -1, -1))
        self.num_promised_slots = 0

    def _admit(self) -> None:
        """Waiting requests take free slots in order while their KV room can be reserved; the samples of a prompt
        with n > 1 (`workers/samples.py`) are admitted together, their forks' slots promised until they fork."""
        while self.waiting and len(self.free_slots) > self.num_promised_slots:
            request = self.waiting[0]
            need = self._positions_needed(request)
            num_fork_blocks = fork_reservation(request, self.blocks, need, self.mtp)
            problem = self._never_fits(request, need, num_fork_blocks)
            if problem is not None:
                self.waiting.popleft()
                self._reject(request, problem)
                continue
            num_samples = group_size(request)
            if not self.blocks.can_ever_hold(need) or num_samples > len(self.free_slots) - self.num_promised_slots:
                return  # longer than this workspace's slots (it grows when the running requests are done), or
                # its samples wait for slots
            hit = PrefixHit() if self.sharing is None else self.sharing.lookup(request, self.prefilling)
            if hit is None:
                return  # a request now prefilling is about to checkpoint more of this prompt: wait for it
            shared = hit.chain if self.sharing is None else self.sharing.shared_blocks(hit)
            newly_pinned = sum(entry.refs == 0 for entry in hit.chain)
            reserved = self.blocks.try_reserve(need, len(shared), newly_pinned, num_fork_blocks)
            if reserved is None:
                return  # waits until running requests give their room back
            self.waiting.popleft()
            request.slot, request.num_reserved = self.free_slots.pop(), need
            request.num_reserved_blocks = reserved - num_fork_blocks
            self.num_promised_slots += num_samples - 1
            if self.proposer is not None:
                self.proposer.admit([request])
            if self.sharing is not None:
                self.num_prefix_hit_tokens += self.sharing.start(request, hit, self.waiting, self.prefilling)
            self.prefilling.append(request)

    def _never_fits(self, request: Request, need: int, num_fork_blocks: int) -> str | None:
        """Why a waiting request (with its samples) could never be admitted, or None."""
        num_blocks = self.blocks.blocks_for(need) + num_fork_blocks
        if self.num_kv_blocks is not None and num_blocks > self.num_kv_blocks - 1:
            what = f"{need} KV cache positions (prompt + max_tokens + drafts)"
            if request.group is not None:
                what = f"{num_blocks} KV blocks for its {group_size(request)} samples of {what} (prompt blocks shared)"
            return (
                f"needs {what}, more than the KV cache "
                f"holds ({(self.num_kv_blocks - 1) * self.blocks.block_size} positions): raise max_memory / "
                "gpu_memory_utilization, or lower max_tokens"
            )
        max_slots = min(self.config.max_num_seqs, self.budget.max_num_batched_tokens)
        if group_size(request) > max_slots:
            return f"n={group_size(request)} samples need as many slots, more than max_num_seqs={max_slots}"
        return None

    def _reject(self, request: Request, problem: str) -> None:
        """A waiting request that can never run finishes with an error (each of its samples)."""
        samples = [request] + ([] if request.group is None else request.group.forks)
        for sample in samples:
            sample.finish_reason, sample.error = "error", problem
            self.finished.append(sample)

    def fork(self, leader: Request) -> list[Request]:
        """A leader's prefill completed: its forks take their promised slots with copies of its state."""
        forks = fork_samples(leader, self.pool, self.proposer, self.free_slots, self.mtp)
        if self.sharing is not None:
            for fork in forks:
                self.sharing.follow(leader, fork)
        self.num_promised_slots -= len(forks)
        return forks

    def retire(self, request: Request) -> None:
        """A finished request gives back its slot, its KV blocks and its prefix-cache references."""
        self.retired.add(request.index)  # the policy forgets it once it has learnt from this step
        if self.sharing is not None:
            self.sharing.release(request)
        self.blocks.free_slot(request.slot)
        self.blocks.release(request.num_reserved_blocks)
        leave_group(request, self.blocks)
        self.free_slots.append(request.slot)
        self.finished.append(request)

    def compact(self) -> None:
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
