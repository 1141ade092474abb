"""The scheduler's side of prefix caching (`workers/prefix_cache.py` holds the cache itself): which cached prefix a
request starts from, sharing its KV blocks and restoring its states, where its prefill stops to checkpoint, and
what a prefill forward adds to the cache.

An MTP proposer shares all of a hit's blocks but the last, which the request gets a private copy of: the head's
entry at the prefix's last position pairs it with the next token, which is the request's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from workers.model import HybridModel, StatePool
from workers.model.kv_blocks import BlockTable
from workers.prefix_cache import (
    CHECKPOINT_MULTIPLE,
    MIN_PREFILL_REST,
    CheckpointStore,
    PrefixCache,
    PrefixHit,
    common_prefix_length,
)
from workers.requests import Request
from workers.spec_decode.proposal import Proposer

UPCOMING_PROMPTS = 64  # waiting prompts an admitted request's checkpoints are planned against


def scan_chunk(model: HybridModel) -> int:
    """The recurrent layers' prefill chunk: a continued prefill computes what one forward does only from its
    multiples (the chunked scans' grids start at each forward's first token)."""
    config = model.config
    chunks = [c.chunk_size for c in (config.mamba, config.gdn, config.kda) if c is not None]
    return max(chunks, default=1)


class PrefixSharing:
    """Prefix caching over one workspace's slots and KV blocks, for one scheduler."""

    def __init__(self, model: HybridModel, pool: StatePool, num_checkpoints: int, proposer: Proposer | None):
        """`num_checkpoints` state checkpoints; `proposer` drafting from the target's hidden states (an MTP head,
        which has `observe_target`) makes the checkpoints keep the last hidden state too."""
        self.mtp = proposer is not None and proposer.drafts_from_hidden
        self.proposer = proposer
        self.pool: StatePool = pool
        self.blocks: BlockTable = pool.blocks
        store = CheckpointStore(pool, num_checkpoints, model.config.hidden_size if self.mtp else 0)
        self.cache = PrefixCache(self.blocks, store, max(CHECKPOINT_MULTIPLE, scan_chunk(model)))

    def lookup(self, request: Request, prefilling: Sequence[Request]) -> PrefixHit | None:
        """The longest cached prefix of `request`'s prompt; None when the request should wait a step because a
        request now prefilling will checkpoint a longer prefix of it (rows of one template admitted together: the
        first computes the template, the others wait for it)."""
        hit = self.cache.lookup(request.prompt)
        for other in prefilling:
            for stop in other.prefill_stops:
                if hit.num_tokens < stop and other.num_computed < stop <= len(request.prompt) - MIN_PREFILL_REST:
                    if common_prefix_length(request.prompt, other.prompt) >= stop:
                        return None
        return hit

    def shared_blocks(self, hit: PrefixHit) -> list:
        """The hit's blocks a request shares (with an MTP proposer, all but the last)."""
        return hit.chain[:-1] if self.mtp and hit.chain else hit.chain

    def start(self, request: Request, hit: PrefixHit, waiting: Iterable[Request], prefilling: list[Request]) -> int:
        """Share the hit's KV blocks with the admitted `request`, restore its states, and plan where its prefill
        stops to checkpoint (against the prompts waiting and prefilling). Returns the prompt tokens restored."""
        cache = self.cache
        shared = self.shared_blocks(hit)
        cache.acquire(hit.chain)  # all of it: a block the request does not share still anchors its path
        request.prefix_path = list(hit.chain)
        self.blocks.share(request.slot, [entry.block for entry in shared])
        if hit.num_tokens:
            if len(shared) < len(hit.chain):  # the private copy of the last block
                self.blocks.ensure(request.slot, hit.num_tokens)
                self.blocks.copy_block(hit.chain[-1].block, self.blocks.owned[request.slot][-1])
            cache.store.restore(hit.checkpoint, self.pool, request.slot)
            request.num_computed = request.num_cached_tokens = hit.num_tokens
            if self.mtp:  # the head catches up from the prefix's last position, with this request's next token
                self.proposer.resume_from(request, hit.num_tokens - 1, cache.store.hidden[hit.checkpoint])
        upcoming = [r.prompt for r in itertools.islice(waiting, UPCOMING_PROMPTS)] + [r.prompt for r in prefilling]
        stops = cache.checkpoint_positions(request.prompt, upcoming)
        request.prefill_stops = [stop for stop in stops if stop > hit.num_tokens]
        return hit.num_tokens

    def after_prefill(self, requests: list[Request], hidden: torch.Tensor, chunks: list[int]) -> None:
        """After a prefill forward (final hidden [b, l, d], chunks[i] new tokens per row): cache the prompt blocks
        computed, checkpoint states where a prefill stopped. An MTP head first consumes the chunk (its KV of cached
        blocks must be written before another request shares them)."""
        cache = self.cache
        if self.mtp:
            self.proposer.consume_known(requests)
        for row, request in enumerate(requests):
            path = request.prefix_path
            taken = cache.insert(request.prompt, request.slot, path, request.num_computed)
            request.num_reserved_blocks -= taken  # the cache's (pinned) now
            self.blocks.release(taken)
            if request.num_computed in request.prefill_stops and len(path) * self.blocks.block_size == (
                request.num_computed
            ):
                cache.save_checkpoint(path[-1], self.pool, request.slot, hidden[row, chunks[row] - 1])

    def follow(self, leader: Request, fork: Request) -> None:
        """A fork of `leader` (`workers/samples.py`) holds the same cached prompt blocks: it references its path too."""
        fork.prefix_path = list(leader.prefix_path)
        self.cache.acquire(fork.prefix_path)

    def release(self, request: Request) -> None:
        """A request leaves: its path's references go back to the cache."""
        self.cache.release(request.prefix_path)
        request.prefix_path = []
