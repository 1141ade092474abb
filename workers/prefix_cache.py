"""Prefix state caching for hybrid models (vLLM's `enable_prefix_caching`): rows that share a prompt prefix compute
it once.

Attention KV can be sliced at any block; recurrent layers cannot (their state after position t is a summary of
everything before it). So the cache keeps two things, keyed by the prompt's tokens block by block (a chain: a
block's key is its parent's entry and its own tokens, compared exactly):
- **KV blocks**: a prompt block a request has computed becomes a cached block (one `BlockTable` block, shared by
  reference: later requests' tables point at it; `refs` counts the live requests using it);
- **state checkpoints**: the recurrent states (conv window + SSM / delta-rule state of every layer) after some
  block boundaries, each in a slot of a `CheckpointStore`.
A new request restores the longest prefix that ends at a checkpoint, shares its KV blocks, and prefills only the
rest. Which boundaries get a checkpoint: the last one of each prompt, and the one where a prompt stops matching the
cache (where rows diverge from a shared template); only at multiples of `CHECKPOINT_MULTIPLE` (and of the model's
scan chunk), where a continued prefill computes what one forward over the whole prompt does (the chunked scans'
grids and the attention tiles line up), and never closer than `MIN_PREFILL_REST` tokens to the prompt's end (a
shorter rest takes the decode-step kernels, which round differently). Unused entries are evicted LRU, leaves first,
when blocks or checkpoint slots run short: admission never waits for the cache.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workers.model.kv_blocks import BlockTable
from workers.model.state import StatePool

CHECKPOINT_MULTIPLE = 64  # positions: the attention tile, the 32-float vector tails and the GDN chunk line up
MIN_PREFILL_REST = 9  # prompt tokens a restored request computes at least (fewer run as decode steps)


@dataclass(eq=False)
class CachedBlock:
    """One cached prompt block: its KV block, and the recurrent states after it when checkpointed."""

    key: tuple[int, tuple[int, ...]]  # (parent entry's id, this block's tokens)
    id: int
    parent: CachedBlock | None
    block: int  # KV block id in the BlockTable
    checkpoint: int | None = None  # CheckpointStore slot holding the states after this block
    refs: int = 0  # live requests using it
    last_used: int = 0
    children: int = 0


@dataclass
class PrefixHit:
    """What a new request can reuse: the cached blocks it shares (in order), restorable up to `num_tokens`."""

    chain: list[CachedBlock] = field(default_factory=list)
    num_tokens: int = 0  # positions restored: the shared blocks' positions, ending at a checkpoint
    checkpoint: int | None = None


class CheckpointStore:
    """Recurrent states saved after cached blocks, one slot each: [layers, num_checkpoints, …] like a `StatePool`'s."""

    def __init__(self, pool: StatePool, num_checkpoints: int, hidden_size: int = 0):
        """Slots shaped like `pool`'s recurrent states, `num_checkpoints` of them; `hidden_size` > 0 also keeps the
        target's final hidden state at the checkpoint's last position (what an MTP head catches up from)."""
        self.conv = pool.conv.new_empty(pool.conv.shape[0], num_checkpoints, *pool.conv.shape[2:])
        self.ssm = pool.ssm.new_empty(pool.ssm.shape[0], num_checkpoints, *pool.ssm.shape[2:])
        self.hidden = pool.conv.new_empty(num_checkpoints, hidden_size) if hidden_size else None
        self.num_checkpoints = num_checkpoints

    def save(self, index: int, pool: StatePool, slot: int, hidden: torch.Tensor | None = None) -> None:
        """Copy the states of `pool`'s `slot` (and the last position's `hidden` [d]) into checkpoint `index`."""
        self.conv[:, index] = pool.conv[:, slot]
        self.ssm[:, index] = pool.ssm[:, slot]
        if self.hidden is not None and hidden is not None:
            self.hidden[index] = hidden

    def restore(self, index: int, pool: StatePool, slot: int) -> None:
        """Copy checkpoint `index` into `pool`'s `slot`."""
        pool.conv[:, slot] = self.conv[:, index]
        pool.ssm[:, slot] = self.ssm[:, index]


class PrefixCache:
    """The chain of cached prompt blocks over a `BlockTable`, with state checkpoints (see the module docstring)."""

    def __init__(self, blocks: BlockTable, store: CheckpointStore, multiple: int = CHECKPOINT_MULTIPLE):
        """`multiple`: checkpoint positions are multiples of it (and of the block size)."""
        self.blocks, self.store = blocks, store
        self.multiple = multiple
        self.entries: dict[tuple[int, tuple[int, ...]], CachedBlock] = {}
        self.free_checkpoints = list(range(store.num_checkpoints - 1, -1, -1))
        self.evictable: OrderedDict[int, CachedBlock] = OrderedDict()  # unused leaves, least recently used first
        self.checkpointed: dict[int, CachedBlock] = {}  # entries holding a checkpoint
        self._ids = itertools.count(1)
        self._clock = itertools.count()
        blocks.reclaim = self.evict_blocks

    # ------------------------------------------------------------------------------------------------- lookup
    def match(self, prompt: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks that match the prompt's full blocks from its start, in order."""
        size, chain, parent_id = self.blocks.block_size, [], 0
        for start in range(0, len(prompt) - size + 1, size):
            entry = self.entries.get((parent_id, tuple(prompt[start : start + size])))
            if entry is None:
                break
            chain.append(entry)
            parent_id = entry.id
        return chain

    def lookup(self, prompt: Sequence[int]) -> PrefixHit:
        """The longest restorable prefix: a matching chain ending at a checkpoint, leaving the prompt's rest."""
        chain = self.match(prompt)
        limit = len(prompt) - MIN_PREFILL_REST
        for depth in range(len(chain), 0, -1):
            entry = chain[depth - 1]
            if entry.checkpoint is not None and depth * self.blocks.block_size <= limit:
                return PrefixHit(chain[:depth], depth * self.blocks.block_size, entry.checkpoint)
        return PrefixHit()

    def checkpoint_positions(self, prompt: Sequence[int], other_prompts: Sequence[Sequence[int]]) -> list[int]:
        """Where a request's prefill should stop to checkpoint: the longest prefix it shares with the cache or with
        other prompts (waiting or prefilling: a template's end, for the rows that follow). None when it shares
        nothing (a prompt of its own costs no extra forward)."""
        limit = self.boundary(len(prompt) - MIN_PREFILL_REST)
        if limit == 0:
            return []  # too short to checkpoint anywhere: nothing to compare
        matched = len(self.match(prompt)) * self.blocks.block_size
        for other in other_prompts:
            if matched >= limit:
                break
            if other is not prompt:
                matched = max(matched, common_prefix_length(prompt, other))
        stop = self.boundary(min(matched, limit))
        return [stop] if stop > 0 else []

    def boundary(self, position: int) -> int:
        """The last checkpoint position at or before `position` (0 when none)."""
        return max(0, position) // self.multiple * self.multiple

    # ------------------------------------------------------------------------------------------- references
    def acquire(self, chain: Sequence[CachedBlock]) -> None:
        """A request uses these blocks now (they are pinned: not evictable, not available)."""
        tick = next(self._clock)
        for entry in chain:
            if entry.refs == 0:
                self.blocks.num_pinned += 1
                self.evictable.pop(entry.id, None)
            entry.refs += 1
            entry.last_used = tick

    def release(self, chain: Sequence[CachedBlock]) -> None:
        """A request finished with these blocks (they stay cached, evictable once no one uses them)."""
        for entry in chain:
            entry.refs -= 1
            assert entry.refs >= 0, "a cached block released more often than acquired"
            if entry.refs == 0:
                self.blocks.num_pinned -= 1
                self._maybe_evictable(entry)

    def _maybe_evictable(self, entry: CachedBlock) -> None:
        """Queue an unused leaf for eviction (most recently used last)."""
        if entry.refs == 0 and entry.children == 0:
            self.evictable[entry.id] = entry

    # --------------------------------------------------------------------------------------------- inserting
    def insert(self, prompt: Sequence[int], slot: int, path: list[CachedBlock], num_computed: int) -> int:
        """Cache the full prompt blocks of `slot` computed so far; `path` (the request's prompt blocks as cache
        entries, by index, all acquired: none is evicted under it) grows with them. A block whose tokens another
        slot cached meanwhile stays the slot's own (the path goes through the other entry while a request uses it,
        else ends). Returns how many of the slot's own blocks the cache took over (pinned now, no longer reserved)."""
        size, taken = self.blocks.block_size, 0
        for index in range(len(path), min(num_computed, len(prompt)) // size):
            parent = path[-1] if path else None
            key = ((parent.id if parent else 0), tuple(prompt[index * size : (index + 1) * size]))
            entry = self.entries.get(key)
            if entry is None:  # the slot's block becomes the cached one
                block = self.blocks.owned[slot][index]
                entry = CachedBlock(key, next(self._ids), parent, block)
                self.entries[key] = entry
                self.blocks.cached.add(block)
                if parent is not None:
                    parent.children += 1
                    self.evictable.pop(parent.id, None)
                taken += 1
            elif entry.refs == 0:
                break  # cached by another slot and unused now: pinning it would overdraw the reservations
            self.acquire([entry])
            path.append(entry)
        return taken

    def save_checkpoint(self, entry: CachedBlock, pool: StatePool, slot: int, hidden: torch.Tensor | None) -> None:
        """Keep the states of `slot` (which has just computed through `entry`, its last position's final hidden
        state `hidden`) as `entry`'s checkpoint."""
        if entry.checkpoint is not None:
            return
        if not self.free_checkpoints and not self._evict_checkpoint():
            return  # every checkpoint belongs to a block in use: this one goes without
        entry.checkpoint = self.free_checkpoints.pop()
        self.checkpointed[entry.id] = entry
        self.store.save(entry.checkpoint, pool, slot, hidden)

    # ---------------------------------------------------------------------------------------------- eviction
    def evict_blocks(self, num_blocks: int) -> None:
        """Free up to `num_blocks` blocks: unused leaves, least recently used first (a parent left without
        children becomes a leaf in its turn)."""
        for _ in range(num_blocks):
            if not self.evictable:
                return
            _, entry = self.evictable.popitem(last=False)
            self._remove(entry)

    def _evict_checkpoint(self) -> bool:
        """Free the checkpoint of the least recently used unused block; False when every one is in use."""
        owners = [e for e in self.checkpointed.values() if e.refs == 0]
        if not owners:
            return False
        entry = min(owners, key=lambda e: e.last_used)
        self._drop_checkpoint(entry)
        return True

    def _drop_checkpoint(self, entry: CachedBlock) -> None:
        if entry.checkpoint is not None:
            self.free_checkpoints.append(entry.checkpoint)
            entry.checkpoint = None
            del self.checkpointed[entry.id]

    def _remove(self, entry: CachedBlock) -> None:
        """Drop an unused leaf entry, its block back to the free pool."""
        del self.entries[entry.key]
        self.blocks.free_block(entry.block)
        self._drop_checkpoint(entry)
        if entry.parent is not None:
            entry.parent.children -= 1
            self._maybe_evictable(entry.parent)


def common_prefix_length(a: Sequence[int], b: Sequence[int], step: int = 64) -> int:
    """How many leading tokens two prompts share (compared a slice at a time, then token by token)."""
    n, i = min(len(a), len(b)), 0
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
