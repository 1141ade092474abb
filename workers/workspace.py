"""A scheduler's workspace: the state slots, KV blocks and the plan executing decode steps over them, kept across
requests and `generate` calls, and how a workspace that no longer fits grows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.executors import extra_slots
from workers.model import StatePool
from workers.model.steps.cuda_graph import GraphPlan
from workers.model.steps.decode_plan import DecodePlan


@dataclass
class Workspace:
    """State slots and the plan that executes decode steps over them (`workers/executors.py`), kept by the runner
    so successive `generate` calls reuse them (a plan's records and buffers cost 10–30 ms to set up, CUDA graph
    captures far more). Stale slot contents are harmless: a slot's states are written at admission before they are
    read, and attention never reads past a request's own position."""

    pool: StatePool
    plan: DecodePlan | GraphPlan | None
    executor: str  # "module", "native" or "graph" (see workers/executors.py)
    capture_failure: str | None = None  # why CUDA graph capture failed (the steps then run module by module)

    def release(self) -> None:
        """Free the slots' storage and drop the plan now (a larger workspace replaces this one)."""
        self.pool.release()
        self.plan = None

    def fits(self, num_slots: int, capacity: int, tokens_per_row: int, executor: str, num_blocks: int) -> bool:
        """Whether this workspace can serve a run needing these sizes with this executor."""
        return (
            self.pool.num_slots - extra_slots(self.executor) >= num_slots
            and self.pool.capacity >= capacity
            and self.pool.blocks.num_blocks >= num_blocks
            and self.executor == executor
            and (self.plan is None or self.plan.tokens_per_row >= tokens_per_row)
        )


def grown(
    workspace: Workspace, num_slots: int, capacity: int, num_blocks: int, max_capacity: int
) -> tuple[int, int, int]:
    """Sizes of the workspace replacing `workspace`: what the waiting requests need, never less than the old one had
    (runs that alternate between two shapes rebuild at most once), positions at most `max_capacity` unless needed."""
    old = workspace.pool
    if capacity > old.capacity:  # at least doubled: a stream of ever longer requests drains the batch rarely
        capacity = max(capacity, min(2 * old.capacity, max_capacity))
    return (
        max(num_slots, old.num_slots - extra_slots(workspace.executor)),
        max(capacity, old.capacity),
        max(num_blocks, old.blocks.num_blocks),
    )


def workspace_sizes(
    positions_needed: list[int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_kv_blocks: int | None,
    block_size: int,
) -> tuple[int, int, int]:
    """(slots, positions per slot, KV blocks) for requests needing these KV positions: a slot per request up to
    `max_num_seqs` (and the token budget), the longest request's positions, KV blocks for every slot's longest
    request within `num_kv_blocks` (None: no bound; at least the null block and one more)."""
    capacity = max(positions_needed)
    num_slots = max(1, min(max_num_seqs, len(positions_needed), max_num_batched_tokens))
    max_blocks = 1 + num_slots * math.ceil(capacity / block_size)
    num_blocks = max_blocks if num_kv_blocks is None else max(2, min(num_kv_blocks, max_blocks))
    return num_slots, capacity, num_blocks
