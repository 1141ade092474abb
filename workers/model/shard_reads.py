"""One parameter's share for one tensor-parallel rank, read from the checkpoint without reading what the rank drops.

`read_shard(source, rule, rank, tensors, shape)` returns exactly `rule.apply(read_source(source, tensors), rank)`
(the same values, bit for bit), reading as little as the source's layout allows:
1. `rank0_only` on a rank other than 0: zeros, nothing read.
2. A cut of dim 0 (the rows of a weight, the experts of a stack) on one tensor or on tensors concatenated along
   dim 0: only those rows' bytes are read (`CheckpointTensors.read_rows`; an FP8 weight with its scale rows).
3. Stacked experts (one key or a group of keys per expert, or one fused `[E, …]` tensor): only the rank's experts
   are read, and each is cut before it is stacked, so the largest temporary is one expert, not the whole stack.
4. A source with a transform (a de-interleave, a multiplier, a `+1` norm, a copy check): the full tensor is read
   and transformed as at one rank, then cut. These are one layer's tensors, small beside the experts.
A cut along another dim commutes with a cut of dim 0 (both only select), so the dim-0 cut is read first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from workers.model.checkpoint.weights import Source
from workers.model.distributed.slices import Cut, ShardRule

Pieces = Sequence[tuple[int, int]]


class TensorReader(Protocol):
    """What `read_shard` reads from: `CheckpointTensors`, or a view of its FP8 bytes (`fp8_shards.py`)."""

    shapes: Mapping[str, tuple[int, ...]]

    def read(self, key: str) -> torch.Tensor: ...

    def read_rows(self, key: str, pieces: Pieces, out: torch.Tensor | None = None, flat: int = 1) -> torch.Tensor: ...

    def read_dtype(self, key: str) -> torch.dtype: ...


def read_source(source: Source, tensors: TensorReader) -> torch.Tensor:
    """The full parameter `source` describes (what a single rank loads)."""
    parts = [tensors.read(key) for key in source.keys]
    if source.transform is not None:
        return source.transform(parts)
    if source.combine == "cat":
        return torch.cat(parts, dim=0)
    if source.combine == "stack":
        group = source.group
        return torch.stack([torch.cat(parts[i : i + group]) for i in range(0, len(parts), group)])
    return parts[0]


def local_shape(rule: ShardRule, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape `rule` cuts a tensor of `shape` to."""
    local = list(shape)
    for cut in rule.cuts:
        local[cut.dim] = cut.length
    if rule.pad_rows:
        local[0] += rule.pad_rows
    return tuple(local)


def read_shard(source: Source, rule: ShardRule, rank: int, tensors: TensorReader, shape: Sequence[int]) -> torch.Tensor:
    """`rule.apply(read_source(source, tensors), rank)`, reading only what the rank keeps where the layout allows
    (module docstring); `shape`: the full parameter's shape."""
    if rule.rank0_only and rank != 0:
        dtype = tensors.read_dtype(source.keys[0]) if source.keys else torch.float32
        return torch.zeros(local_shape(rule, shape), dtype=dtype)
    if not rule.cuts and not rule.pad_rows:
        return read_source(source, tensors)
    cuts = tuple(Cut(cut.dim % len(shape), cut.pieces) for cut in rule.cuts)
    local = _read_cut(source, cuts, tensors)
    if rule.pad_rows:
        local = torch.cat([local, local.new_zeros((rule.pad_rows, *local.shape[1:]))])
    return local


def apply_cuts(tensor: torch.Tensor, cuts: Sequence[Cut]) -> torch.Tensor:
    """`tensor` cut by `cuts` in order, as `ShardRule.apply` cuts it."""
    for cut in cuts:
        tensor = torch.cat([tensor.narrow(cut.dim, start, length) for start, length in cut.pieces], dim=cut.dim)
    return tensor


def leading_rows(cuts: Sequence[Cut]) -> tuple[Pieces | None, tuple[Cut, ...]]:
    """(the pieces of the first dim-0 cut, the other cuts) when no dim-0 cut precedes it, so that it can be read
    first; (None, cuts) when there is none."""
    for i, cut in enumerate(cuts):
        if cut.dim == 0:
            return cut.pieces, (*cuts[:i], *cuts[i + 1 :])
    return None, tuple(cuts)


def _read_cut(source: Source, cuts: tuple[Cut, ...], tensors: TensorReader) -> torch.Tensor:
    rows, rest = leading_rows(cuts)
    if source.transform is not None or not source.keys or any(cut.dim == 0 for cut in rest):
        return apply_cuts(read_source(source, tensors), cuts)  # (no rule cuts dim 0 twice)
    if source.combine == "stack":
        group = source.group
        items = [tuple(source.keys[i : i + group]) for i in range(0, len(source.keys), group)]
        return _stack_items(items, rows, rest, tensors, fused=False)
    fused_stack = source.combine == "one" and len(tensors.shapes[source.keys[0]]) >= 3
    if fused_stack and rest:  # [E, …] with a cut inside the experts: one expert at a time
        items = [(source.keys[0],)] * tensors.shapes[source.keys[0]][0]
        return _stack_items(items, rows, rest, tensors, fused=True)
    return read_rows_of_cat(source.keys, rows, rest, tensors)


def read_rows_of_cat(
    keys: Sequence[str], rows: Pieces | None, rest: Sequence[Cut], tensors: TensorReader
) -> torch.Tensor:
    """`keys` concatenated along dim 0, of which only the `rows` pieces (all rows when None) are read, then cut
    by `rest`."""
    if rows is None:
        parts = [tensors.read(key) for key in keys]
        return apply_cuts(parts[0] if len(parts) == 1 else torch.cat(parts), rest)
    segments = _segments(keys, [tensors.shapes[key][0] for key in keys], rows)
    if len(segments) == 1:
        key, start, length = segments[0]
        return apply_cuts(tensors.read_rows(key, [(start, length)]), rest)
    dtype = tensors.read_dtype(keys[0])
    for key in keys[1:]:
        dtype = torch.promote_types(dtype, tensors.read_dtype(key))
    out = torch.empty((sum(n for _, _, n in segments), *tensors.shapes[keys[0]][1:]), dtype=dtype)
    position = 0
    for key, start, length in segments:
        slot = out.narrow(0, position, length)
        part = tensors.read_rows(key, [(start, length)], out=slot)
        if part is not slot:
            slot.copy_(part)
        position += length
    return apply_cuts(out, rest)


def _segments(keys: Sequence[str], sizes: Sequence[int], pieces: Pieces) -> list[tuple[str, int, int]]:
    """The rows `pieces` of the concatenation of `keys` (with `sizes` rows each) as (key, start, length) runs."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    segments = []
    for start, length in pieces:
        while length > 0:
            k = max(i for i in range(len(keys)) if offsets[i] <= start)
            take = min(length, offsets[k + 1] - start)
            if take <= 0:
                raise ValueError(f"rows {start}…{start + length} lie past the {offsets[-1]} rows of {list(keys)}")
            segments.append((keys[k], start - offsets[k], take))
            start, length = start + take, length - take
    return segments


def _stack_items(
    items: Sequence[tuple[str, ...]], rows: Pieces | None, rest: tuple[Cut, ...], tensors: TensorReader, fused: bool
) -> torch.Tensor:
    """Stack `items[e]` for the experts e in `rows` (all when None), each cut by `rest` (dims of the stack) before
    it joins: an item is its keys concatenated along dim 0 (`fused`: expert e's row of the one key)."""
    experts = [e for start, length in (rows or ((0, len(items)),)) for e in range(start, start + length)]
    item_cuts = tuple(Cut(cut.dim - 1, cut.pieces) for cut in rest)
    item_rows, item_rest = leading_rows(item_cuts)
    out: torch.Tensor | None = None
    for i, e in enumerate(experts):
        if fused and item_rows is not None:  # the item's rows of the fused [E, R, …] as rows of [E·R, …]
            size = tensors.shapes[items[e][0]][1]
            flat_rows = [(e * size + start, length) for start, length in item_rows]
            item = apply_cuts(tensors.read_rows(items[e][0], flat_rows, flat=2), item_rest)
        elif fused:
            item = apply_cuts(tensors.read_rows(items[e][0], [(e, 1)])[0], item_cuts)
        else:
            item = read_rows_of_cat(items[e], item_rows, item_rest, tensors)
        if out is None:
            out = torch.empty((len(experts), *item.shape), dtype=item.dtype)
        out[i] = item
        del item
    assert out is not None, "a stack rule selected no expert"
    return out
