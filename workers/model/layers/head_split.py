"""The pieces of a split layer's parameters that one rank holds: helpers for the layers' `shard_rules`.

A layer built for tensor parallelism holds local head counts (`shard_config`); the full tensor's layout is the
local one with every split piece T times longer, so rank r's share of a piece that starts at `offset` in the full
tensor is `[offset + r·local, +local)`. A column-parallel linear (output rows split) keeps its bias's matching rows;
a row-parallel one (input columns split) returns a partial sum, so its bias is kept whole on rank 0 alone.
"""

from __future__ import annotations

from torch import nn

from workers.model.distributed.layout import TensorParallel
from workers.model.distributed.slices import ShardRule, columns, rows

RANK0_ONLY = ShardRule(rank0_only=True)


def share(tp: TensorParallel, local: int, offset: int = 0) -> tuple[int, int]:
    """(start, length) of this rank's `local`-long contiguous share of a piece starting at `offset`."""
    return offset + tp.rank * local, local


def column_parallel(name: str, module: nn.Module, rule: ShardRule) -> dict[str, ShardRule]:
    """Rules for a linear whose output rows `rule` cuts (its bias alike). `module` may be a shared linear with a
    use's low-rank adapter (`base`, `adapter`: Zamba2): the adapter's `up` rows are cut alike, its `down` kept."""
    base = getattr(module, "base", module)
    prefix = f"{name}.base" if base is not module else name
    stated = {f"{prefix}.weight": rule}
    if getattr(base, "bias", None) is not None:
        stated[f"{prefix}.bias"] = rule
    if getattr(module, "adapter", None) is not None:
        stated[f"{name}.adapter.up.weight"] = rule
    return stated


def row_parallel(name: str, module: nn.Module, *pieces: tuple[int, int]) -> dict[str, ShardRule]:
    """Rules for a linear whose input columns are these pieces: a partial output, its bias on rank 0 only."""
    stated = {f"{name}.weight": columns(*pieces)}
    if getattr(module, "bias", None) is not None:
        stated[f"{name}.bias"] = RANK0_ONLY
    return stated


def head_rows(tp: TensorParallel, *locals_and_offsets: tuple[int, int]) -> ShardRule:
    """A rows rule from `(local length, full offset)` pairs: this rank's share of each piece, concatenated."""
    return rows(*(share(tp, local, offset) for local, offset in locals_and_offsets))
