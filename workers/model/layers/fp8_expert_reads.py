"""Where FP8-kept experts (`layers/fp8_experts.py`) read their bytes and block scales, and how a rank's share is cut
from them without ever putting two scales in one block.

A MoE's up (or down) weight assembles, for E experts, a `[E, rows, cols]` tensor from one fused checkpoint tensor or
from p tensors per expert stacked along the rows (p = 2: gate, then up). Each of those tensors was quantized on its
own, so the rows fall into *parts* whose 128-row blocks start at the part's first row (gate [0, I) and up [I, 2I)).
A rank under tensor or expert parallelism keeps the pieces its MoE's `shard_rules()` names (`distributed/slices.py`:
experts along dim 0, rows along dim 1, columns along dim 2). The same cut applies to the scales when each piece
starts on a block of its part and fills whole blocks but where it ends its part (design §4 "FP8 slicing"); local
pieces then form at most two parts of rows (`up_split`) and one of columns. Otherwise the experts load dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.model.distributed.slices import REPLICATED, Cut, ShardRule
from workers.model.kernels.fp8 import FP8_BLOCK


def blocks(size: int) -> int:
    """128-blocks that cover `size` elements."""
    return -(-size // FP8_BLOCK)


def stacks_pairs(transform: Any, num_experts: int) -> bool:
    """Whether `transform` stacks [gate_0, up_0, gate_1, up_1, …] into [E, gate rows then up rows, …]: tried on
    one-element stand-ins numbered by position."""
    stand_ins = [torch.full((1, 1), float(i)) for i in range(2 * num_experts)]
    try:
        stacked = transform(stand_ins)
    except Exception:  # a transform written for other shapes: not a plain stacking, so not kept
        return False
    return torch.equal(stacked, torch.arange(2.0 * num_experts).view(num_experts, 2, 1))


def block_pieces(
    pieces: tuple[tuple[int, int], ...], parts: list[tuple[int, int]]
) -> tuple[tuple[tuple[int, int], ...], list[int]] | None:
    """The block-scale pieces that go with element `pieces` (start, length) of a dimension made of `parts` (start,
    length; each quantized apart, its blocks counted from its start), and the local parts they form (lengths); None
    when a piece cuts into a block."""
    offsets, offset = [], 0
    for _, length in parts:
        offsets.append(offset)
        offset += blocks(length)
    scale_pieces, local = [], []
    split = [(max(start, s), min(start + length, s + n)) for start, length in pieces for s, n in parts]
    for start, end in [(start, end) for start, end in split if start < end]:  # each piece cut at part boundaries
        index = next(i for i, (s, n) in enumerate(parts) if s <= start < s + n)
        part_start, part_length = parts[index]
        length, part_end = end - start, part_start + part_length
        if (start - part_start) % FP8_BLOCK or (length % FP8_BLOCK and end != part_end):
            return None
        scale_pieces.append((offsets[index] + (start - part_start) // FP8_BLOCK, blocks(length)))
        if local and local[-1] % FP8_BLOCK == 0:  # the blocks run on across the join
            local[-1] += length
        else:
            local.append(length)
    return tuple(scale_pieces), local


@dataclass(frozen=True)
class ExpertRead:
    """How one rank's FP8 expert weight [E_l, rows_l, cols_l] comes from the checkpoint's `keys`."""

    keys: tuple[str, ...]
    per_expert: int  # 0: one fused [E, rows, cols] tensor; p: p tensors per expert stacked along the rows
    experts: tuple[tuple[int, int], ...]  # the (first, count) pieces of experts this rank holds
    inner: ShardRule  # the cut of one expert's [1, rows, cols] bytes (dims 1 and 2)
    inner_scales: ShardRule  # the same cut of its [1, row blocks, column blocks] scales
    shape: tuple[int, int, int]  # the local weight's
    split: int  # local rows before the second part (= rows_l when there is one part)

    def scale_shape(self) -> tuple[int, int, int]:
        """The local scales' shape."""
        rows, cols = self.shape[1:]
        return self.shape[0], blocks(self.split) + blocks(rows - self.split), blocks(cols)


def plan_read(keys: tuple[str, ...], num_experts: int, tensors: Any, rule: ShardRule) -> ExpertRead | str:
    """How the FP8 `keys` (one fused tensor, or num_experts · p tensors stacked along each expert's rows, p ≤ 2) are
    read and cut by `rule` (the parameter's `shard_rules()` entry, REPLICATED on one rank); or why they cannot be
    kept in FP8."""
    if not keys or not all(tensors.is_fp8(key) for key in keys):
        return "not every expert tensor is block-wise FP8"
    shapes = [tuple(tensors.shapes[key]) for key in keys]
    if len(keys) == 1 and len(shapes[0]) == 3:
        per_expert, (_, rows, cols) = 0, shapes[0]
        parts = [(0, rows)]
    elif len(keys) % num_experts == 0 and len(keys) // num_experts <= 2 and len(set(shapes)) == 1:
        per_expert, (part_rows, cols) = len(keys) // num_experts, shapes[0]
        rows, parts = per_expert * part_rows, [(p * part_rows, part_rows) for p in range(per_expert)]
    else:
        return f"the layout {keys[0]!r}, … ({len(keys)} tensors) is not one the FP8 experts read"
    cuts = {cut.dim: cut.pieces for cut in rule.cuts}
    if len(cuts) != len(rule.cuts) or rule.pad_rows or rule.rank0_only or not set(cuts) <= {0, 1, 2}:
        return f"its shard rule {rule} is not one FP8 experts follow"
    row_cut = block_pieces(cuts.get(1, ((0, rows),)), parts)
    col_cut = block_pieces(cuts.get(2, ((0, cols),)), [(0, cols)])
    if row_cut is None or col_cut is None or len(row_cut[1]) > 2 or len(col_cut[1]) != 1:
        return "this rank's rows or columns of the experts do not fall on whole 128 × 128 blocks"
    experts = cuts.get(0, ((0, shapes[0][0] if per_expert == 0 else num_experts),))
    dims = {1: (cuts.get(1), row_cut[0]), 2: (cuts.get(2), col_cut[0])}
    inner = tuple(Cut(dim, pieces) for dim, (pieces, _) in dims.items() if pieces is not None)
    inner_scales = tuple(Cut(dim, scale_pieces) for dim, (pieces, scale_pieces) in dims.items() if pieces is not None)
    shape = (sum(n for _, n in experts), sum(row_cut[1]), col_cut[1][0])
    return ExpertRead(keys, per_expert, experts, ShardRule(inner), ShardRule(inner_scales), shape, row_cut[1][0])


def read_experts(read: ExpertRead, weight: torch.Tensor, scale: torch.Tensor, tensors: Any) -> None:
    """Fill the uint8 `weight` and float32 `scale` of `read.shape` from the checkpoint, one expert at a time (all
    of a fused tensor at once: one byte per weight)."""
    fused = tensors.read_fp8(read.keys[0]) if read.per_expert == 0 else None
    local = 0
    for first, count in read.experts:
        for expert in range(first, first + count):
            if fused is not None:
                bytes_, scales = fused[0][expert : expert + 1], fused[1][expert : expert + 1]
            else:
                own = [tensors.read_fp8(key) for key in read.keys[expert * read.per_expert :][: read.per_expert]]
                bytes_, scales = torch.cat([b for b, _ in own])[None], torch.cat([s for _, s in own])[None]
            part_rows = bytes_.shape[1] // max(1, read.per_expert)
            expected = (1, max(1, read.per_expert) * blocks(part_rows), blocks(bytes_.shape[2]))
            if tuple(scales.shape) != expected:
                found = f"{tuple(scales.shape[1:])}, not 128 × 128 block scales {expected[1:]}"
                raise ValueError(f"{read.keys[0]}_scale_inv, …: expert {expert} has scales {found}")
            weight[local].copy_(read.inner.apply(bytes_, 0)[0] if read.inner != REPLICATED else bytes_[0])
            scale[local].copy_(read.inner_scales.apply(scales, 0)[0] if read.inner != REPLICATED else scales[0])
            local += 1
