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
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # in admission order
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.retired: set[int] = set()  # request ids retired during this step
        self.num_steps = 0  # steps run, and slots their live requests filled (occupancy = slot steps / steps)
        self.num_slot_steps = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens restored from the prefix cache

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

    def retire(self, request: Request) -> None:
        """A finished request gives back its slot, its KV blocks and its prefix-cache references."""
        self.retired.add(request.index)  # the policy forgets it once it has learnt from this step
        if self.sharing is not None:
            self.sharing.release(request)
        self.blocks.free_slot(request.slot)
        self.blocks.release(request.num_reserved_blocks)
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
