"""n samples per prompt (`SamplingParams.n`): the prompt is prefilled once, then forked into n − 1 more slots.

A prompt with n > 1 is one `SampleGroup`: sample 0 (the leader) waits, is admitted and prefills like any request;
samples 1 … n-1 (the forks) wait inside the group. Admission takes the slots and KV reservations of all n at once,
so a group never half-starts. When the leader's prefill completes, before its first token is sampled, each fork
gets a copy of everything the leader's slot holds: every recurrent state (conv windows, SSM / delta-rule states),
the proposer's per-slot state (a draft model's states and covered count, an MTP head's pending hidden states, an
n-gram index), and the KV blocks — shared (reference-counted by the block table, or pinned through the prefix cache
path the forks acquire too) up to the first block a sample writes into again, which is copied at the fork: every
sample writes its next position into that block at its very first step, so copy-on-write would copy it at once
anyway. With an MTP head that block is the one holding the prompt's last position (the head's entry there pairs
the position with the sample's own next token). Each sample then draws its first token from the prompt's last
logits with its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

import torch

from workers.model import StatePool
from workers.model.kv_blocks import BlockTable
from workers.requests import Request
from workers.sampling import SEED_RANGE, SamplingParams
from workers.spec_decode.proposal import Proposer

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: consecutive sample indices land far apart
_MASK = SEED_RANGE - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed`: `seed` itself for sample 0 (so n = 1 is
    unchanged), else splitmix64's output function of (seed mod 2^64 + sample_index · 0x9E3779B97F4A7C15) — a
    well-mixed 64-bit value, so sample j of row i never collides in practice with the consecutive seeds
    (seed + i) of other rows. It depends on nothing else: not on sharding, batching or the other samples."""
    if sample_index == 0:
        return seed
    x = (seed + sample_index * _GOLDEN_GAMMA) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sample_generators(params: SamplingParams, device: torch.device, seed_source: Random) -> list[torch.Generator]:
    """One generator per sample: seeded with `sample_seed(params.seed, j)`, or a fresh seed from the runner's
    stream each when the request has no seed."""
    generators = []
    for j in range(params.n):
        generator = torch.Generator(device=device)
        seed = sample_seed(params.seed, j) if params.seed is not None else seed_source.getrandbits(63)
        generator.manual_seed(seed % SEED_RANGE)
        generators.append(generator)
    return generators


@dataclass
class SampleGroup:
    """The samples of one prompt beyond the first, and the KV reservations they hold together."""

    forks: list[Request]  # samples 1 … n-1, slotless until the leader's prefill completes
    num_fork_blocks: int = 0  # blocks each fork reserves: its positions beyond the blocks it shares
    num_live: int = 0  # samples not retired yet
    num_shared_reserved: int = 0  # shared blocks not cached: reserved until the last sample retires
    forked: bool = False


def group_requests(requests: list[Request]) -> Request:
    """Tie the n requests of one prompt (in sample order) into a group led by the first; returns the leader."""
    leader = requests[0]
    if len(requests) > 1:
        group = SampleGroup(requests[1:], num_live=len(requests))
        for request in requests:
            request.group = group
    return leader


def group_size(request: Request) -> int:
    """Samples of a waiting leader's prompt (1 without a group)."""
    return 1 if request.group is None else 1 + len(request.group.forks)


def num_shared_blocks(num_prompt_tokens: int, block_size: int, mtp: bool) -> int:
    """The prompt's blocks the samples share: those no sample writes into again (see the module docstring)."""
    return (num_prompt_tokens - 1) // block_size if mtp else num_prompt_tokens // block_size


def fork_reservation(leader: Request, blocks: BlockTable, num_positions: int, mtp: bool) -> int:
    """Blocks the leader's forks reserve together (each: a request of `num_positions` positions less the shared
    blocks); recorded on the group."""
    group = leader.group
    if group is None:
        return 0
    shared = num_shared_blocks(len(leader.prompt), blocks.block_size, mtp)
    group.num_fork_blocks = blocks.blocks_for(num_positions) - shared
    return group.num_fork_blocks * len(group.forks)


def fork_samples(
    leader: Request, pool: StatePool, proposer: Proposer | None, free_slots: list[int], mtp: bool
) -> list[Request]:
    """The leader's prefill just completed: give each fork a slot holding a copy of the leader's state (module
    docstring). Returns the forks, ready to sample their first token."""
    group, blocks = leader.group, pool.blocks
    num_tokens = len(leader.prompt)
    num_shared = num_shared_blocks(num_tokens, blocks.block_size, mtp)
    if proposer is not None:
        proposer.prepare_fork(leader)  # its KV entries of the prompt written before the blocks are copied
    # The leader's own shared blocks outlive it when a fork is still running: the group holds their reservation.
    uncached = sum(block not in blocks.cached for block in blocks.owned[leader.slot][:num_shared])
    leader.num_reserved_blocks -= uncached
    group.num_shared_reserved = uncached
    for fork in group.forks:
        fork.slot = free_slots.pop()
        blocks.fork(leader.slot, fork.slot, num_shared, num_tokens)
        pool.move(leader.slot, fork.slot)  # a copy of every recurrent state
        fork.num_reserved, fork.num_reserved_blocks = leader.num_reserved, group.num_fork_blocks
        fork.num_computed = num_tokens
        fork.num_cached_tokens = leader.num_cached_tokens  # per prompt, as vLLM reports it
    if proposer is not None:
        proposer.fork(leader, group.forks)
    group.forked = True
    return group.forks


def leave_group(request: Request, blocks: BlockTable) -> None:
    """A sample retires; the last one gives back the reservation of the blocks the samples shared."""
    group = request.group
    if group is None:
        return
    group.num_live -= 1
    if not group.num_live:
        blocks.release(group.num_shared_reserved)
