"""Paged KV bookkeeping: which cache blocks hold each slot's positions, and which blocks are free.

An attention layer's cache is `[kv_heads, num_blocks · block_size, head_dim]`; position t of the request in slot s
lives at token index `tables[s, t // block_size] · block_size + t % block_size`. A request holds only the blocks
its own tokens need, so one long request no longer sizes every slot (vLLM's PagedAttention, on a small scale).

Block 0 is the null block: unassigned table entries point at it and nothing valid is ever written there, so a
gather over a padded span reads zeros. Blocks are zeroed when handed out (masked attention multiplies stale
entries by a zero weight; garbage that happens to be NaN would spread). One `BlockTable` serves every cache that
follows the same token positions — the target's layers, a draft model's, an MTP head's — each with its own storage.

Admission reserves a request's worst case (prompt + max_tokens + drafts) in blocks and releases it at the end, so a
running request never waits for memory mid-generation and nothing is ever preempted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import torch

NULL_BLOCK = 0


class BlockTable:
    """Block tables of `num_slots` slots over a shared pool of `num_blocks` blocks (block 0 reserved)."""

    def __init__(
        self, num_slots: int, max_tokens_per_slot: int, num_blocks: int, block_size: int, device: torch.device
    ):
        """`max_tokens_per_slot` bounds one request's positions (its table's width); `num_blocks` counts the null
        block, so at most num_blocks − 1 hold tokens."""
        if block_size < 1 or block_size > 256:
            raise ValueError(f"block_size={block_size} is invalid: must be 1 … 256")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least 2 blocks")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.max_blocks_per_slot = max(1, math.ceil(max_tokens_per_slot / block_size))
        # [num_slots, max_blocks_per_slot] int64 on the model's device; NULL_BLOCK where nothing is assigned.
        self.tables = torch.zeros(num_slots, self.max_blocks_per_slot, dtype=torch.int64, device=device)
        self.owned: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(1, num_blocks))  # a heap: the lowest free block first (long requests stay in runs)
        self._is_free = set(self._free)
        # Blocks present in `_free`: a block taken out of turn (as the next of a run) stays there until popped, so
        # freeing it again must not push a second entry (the heap stays within num_blocks entries for a worker's
        # whole life).
        self._in_heap = set(self._free)
        self.num_reserved = 0
        self.on_allocate: list[Callable[[torch.Tensor], None]] = []  # storages zero the blocks they are handed
        self.storages: list[torch.Tensor] = []  # every storage paged over this table (`attach`)
        # Prefix caching (`workers/prefix_cache.py`): blocks the cache owns (shared between slots, never freed with
        # a slot), how many of them live requests use (`num_pinned`: not evictable, so not available), and the
        # cache's hook that evicts unused ones when the free pool runs short.
        self.cached: set[int] = set()
        self.num_pinned = 0
        self.reclaim: Callable[[int], None] | None = None
        # Forks (`workers/samples.py`): a block the n samples of a prompt share, not cached → how many slots beyond
        # its first hold it (freed with the last of them).
        self.fork_refs: dict[int, int] = {}

    @property
    def num_usable(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` positions occupy."""
        return math.ceil(num_tokens / self.block_size)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether one request of `num_tokens` positions fits at all (in an otherwise empty cache)."""
        return self.blocks_for(num_tokens) <= min(self.num_usable, self.max_blocks_per_slot)

    def try_reserve(
        self, num_tokens: int, num_shared: int = 0, num_newly_pinned: int = 0, num_extra: int = 0
    ) -> int | None:
        """Reserve room for a request of up to `num_tokens` positions whose first `num_shared` blocks are cached
        ones it shares (`num_newly_pinned` of them unused until now), plus `num_extra` blocks (its forks'); returns
        the blocks reserved, or None (nothing reserved) when it does not fit. Unused cached blocks count as
        available: the cache evicts them on demand."""
        total = self.blocks_for(num_tokens)
        need = total - num_shared + num_extra
        if self.num_reserved + need + self.num_pinned + num_newly_pinned > self.num_usable:
            return None
        if total > self.max_blocks_per_slot:
            return None
        self.num_reserved += need
        return need

    def release(self, num_blocks: int) -> None:
        """Give back `num_blocks` of a reservation made with `try_reserve`."""
        self.num_reserved -= num_blocks
        assert self.num_reserved >= 0, "released more than was reserved"

    def share(self, slot: int, blocks: list[int]) -> None:
        """Give the empty `slot` the cached `blocks` as its first blocks (positions 0 … len · block_size − 1)."""
        assert not self.owned[slot], "sharing into a slot that holds blocks"
        self.owned[slot] = list(blocks)
        if blocks:
            self.tables[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)

    def fork(self, source: int, target: int, num_shared: int, num_tokens: int) -> None:
        """Give the empty slot `target` positions 0 … num_tokens-1 of slot `source`: its first `num_shared` blocks
        shared (referenced, never written again), the rest private copies (the blocks the two will write into)."""
        shared = self.owned[source][:num_shared]
        self.share(target, shared)
        for block in shared:
            if block not in self.cached:
                self.fork_refs[block] = self.fork_refs.get(block, 0) + 1
        self.ensure(target, num_tokens)
        for block, copy in zip(self.owned[source][num_shared:], self.owned[target][num_shared:]):
            self.copy_block(block, copy)

    def free_block(self, block: int) -> None:
        """Return one block the cache gave up to the free pool."""
        self.cached.discard(block)
        self._is_free.add(block)
        if block not in self._in_heap:
            self._in_heap.add(block)
            heapq.heappush(self._free, block)

    def ensure(self, slot: int, num_tokens: int) -> None:
        """Assign blocks so positions 0 … num_tokens-1 of `slot` have a place (new blocks are zeroed)."""
        owned = self.owned[slot]
        need = self.blocks_for(num_tokens) - len(owned)
        if need <= 0:
            return
        if len(owned) + need > self.max_blocks_per_slot:
            raise RuntimeError(f"slot {slot} asked for {num_tokens} positions, more than a slot holds")
        if need > len(self._is_free) and self.reclaim is not None:
            self.reclaim(need - len(self._is_free))
        if need > len(self._is_free):
            raise RuntimeError(f"KV cache exhausted: slot {slot} needs {need} more blocks, {len(self._is_free)} free")
        new = [self._take(owned[-1] + 1 if owned else None) for _ in range(need)]
        for block in new:
            owned.append(block)
        self.tables[slot, len(owned) - need : len(owned)] = torch.tensor(new, dtype=torch.int64)
        ids = torch.tensor(new, dtype=torch.int64, device=self.tables.device)
        for zero in self.on_allocate:
            zero(ids)

    def reset(self) -> None:
        """Free every slot's blocks and every reservation (a new run over a reused pool)."""
        for block in list(self.cached):
            self.free_block(block)
        self.num_pinned = 0
        self.fork_refs.clear()
        for slot in range(self.num_slots):
            if self.owned[slot]:
                self.free_slot(slot)
        self.num_reserved = 0
        self._free = sorted(self._is_free)  # a sorted list is a heap; drops entries of blocks taken out of turn
        self._in_heap = set(self._free)

    def attach(self, storages: list[torch.Tensor]) -> None:
        """Page `storages` (KV tensors [..., num_blocks · block_size, head_dim]) over this table: the blocks in use
        and the null block are zeroed now, every block handed out later when it is handed out."""
        in_use = [NULL_BLOCK] + [block for owned in self.owned for block in owned]

        def zero(block_ids: torch.Tensor) -> None:
            where = block_ids[:, None] * self.block_size + torch.arange(self.block_size, device=block_ids.device)
            for storage in storages:
                storage[..., where.view(-1), :] = 0

        zero(torch.tensor(in_use, dtype=torch.int64, device=self.tables.device))
        self.on_allocate.append(zero)
        self.storages += storages

    def copy_block(self, source: int, target: int) -> None:
        """Copy block `source`'s positions into block `target` in every storage paged over this table (a private
        copy of a shared block, to write into)."""
        size = self.block_size
        for storage in self.storages:
            storage[..., target * size : (target + 1) * size, :] = storage[..., source * size : (source + 1) * size, :]

    def _take(self, preferred: int | None) -> int:
        """A free block: `preferred` (the one after the slot's last) when free, else the lowest free one."""
        if preferred is not None and preferred in self._is_free:
            self._is_free.remove(preferred)
            return preferred
        while True:
            block = heapq.heappop(self._free)
            self._in_heap.discard(block)
            if block in self._is_free:
                self._is_free.remove(block)
                return block

    def free_slot(self, slot: int) -> None:
        """Return every block of `slot` to the free pool (but the cached ones, which the cache owns)."""
        for block in self.owned[slot]:
            if block in self.cached:
                continue
            if self.fork_refs.get(block, 0):  # another sample of the prompt still holds it
                self.fork_refs[block] -= 1
                if not self.fork_refs[block]:
                    del self.fork_refs[block]
                continue
            self._is_free.add(block)
            if block not in self._in_heap:
                self._in_heap.add(block)
                heapq.heappush(self._free, block)
        self.owned[slot] = []
        self.tables[slot] = NULL_BLOCK

    def move(self, source: int, target: int) -> None:
        """Hand slot `source`'s blocks to the empty slot `target` (slot compaction: no KV is copied)."""
        assert not self.owned[target], "moving onto a slot that still holds blocks"
        self.owned[target], self.owned[source] = self.owned[source], []
        self.tables[target] = self.tables[source]
        self.tables[source] = NULL_BLOCK

    def contiguous_start(self, slot: int, num_tokens: int) -> int | None:
        """The first token index when positions 0 … num_tokens-1 of `slot` lie in consecutive blocks (the cache can
        then be sliced instead of gathered), else None."""
        blocks = self.owned[slot][: self.blocks_for(num_tokens)]
        if not blocks or any(b - a != 1 for a, b in zip(blocks, blocks[1:])):
            return None
        return blocks[0] * self.block_size

    @classmethod
    def fully_assigned(
        cls, num_slots: int, max_tokens_per_slot: int, block_size: int, device: torch.device
    ) -> BlockTable:
        """A table where every slot already owns consecutive blocks for `max_tokens_per_slot` positions (the
        fixed-capacity layout: for callers that write a slot's positions without asking for blocks first)."""
        per_slot = max(1, math.ceil(max_tokens_per_slot / block_size))
        table = cls(num_slots, max_tokens_per_slot, 1 + num_slots * per_slot, block_size, device)
        for slot in range(num_slots):
            table.ensure(slot, per_slot * block_size)
        table.num_reserved = table.num_usable
        return table
