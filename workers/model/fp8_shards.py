"""A tensor-parallel rank's share of the linears kept in FP8 (`quantization="fp8"`): the e4m3 bytes and block
scales of its rows and columns, cut without dequantizing where the cut follows the 128 × 128 blocks.

A weight W `[out, in]` stores one scale per 128 × 128 block. Rows `[a, e)` take scale rows `[a/128, ⌈e/128⌉)`,
columns likewise, so a rank's slice stays FP8 when every piece of its cut starts on a block boundary and spans
whole blocks, the last piece of a cut may end at the tensor's end instead. A weight whose cut mixes blocks is
dequantized at load instead (it stays an `nn.Linear`, read by `shard_reads.read_shard` like any other), counted in
`dequantized` for the load summary.

`Fp8Shards` is what `layers/fp8_linear.py`'s entry points read from: `keep_fp8_linears(model, shards.kept,
shards)` and `fill_fp8_linears(model, shards.kept, shards)` see one "key" per kept weight (its parameter name),
with the local shape in `shapes` and the local bytes and scales from `read_fp8`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from workers.model.checkpoint.tensors import CheckpointTensors
from workers.model.distributed.slices import Cut, ShardRule
from workers.model.kernels.fp8 import FP8_BLOCK
from workers.model.layers.fp8_linear import read_kept
from workers.model.shard_reads import Pieces, apply_cuts, leading_rows, local_shape, read_rows_of_cat


def block_aligned(rule: ShardRule, shape: Sequence[int], block: int = FP8_BLOCK) -> bool:
    """Whether every cut of `rule` keeps whole `block`-wide blocks of a tensor of `shape`: each piece starts on a
    block boundary and spans whole blocks, except a cut's last piece, which may end at the tensor's end."""
    current = list(shape)
    for cut in rule.cuts:
        dim = cut.dim % len(shape)
        for i, (start, length) in enumerate(cut.pieces):
            whole = length % block == 0 or (i == len(cut.pieces) - 1 and start + length == current[dim])
            if start % block or not whole:
                return False
        current[dim] = cut.length
    return True


def block_cuts(cuts: Sequence[Cut], shape: Sequence[int], block: int = FP8_BLOCK) -> tuple[Cut, ...]:
    """The cuts of the block scales that match `cuts` of a weight of `shape` (aligned: `block_aligned`)."""
    return tuple(
        Cut(cut.dim % len(shape), tuple((start // block, -(-length // block)) for start, length in cut.pieces))
        for cut in cuts
    )


class _Fp8Bytes:
    """`CheckpointTensors`' FP8 weights as stored (e4m3 bytes as uint8), for `read_rows_of_cat`."""

    def __init__(self, tensors: CheckpointTensors):
        self.tensors, self.shapes = tensors, tensors.shapes

    def read(self, key: str) -> torch.Tensor:
        return self.tensors.read_fp8_rows(key, [(0, self.shapes[key][0])])

    def read_rows(self, key: str, pieces: Pieces, out: torch.Tensor | None = None, flat: int = 1) -> torch.Tensor:
        return self.tensors.read_fp8_rows(key, pieces)

    def read_dtype(self, key: str) -> torch.dtype:
        return torch.uint8


class Fp8Shards:
    """The kept FP8 weights of one rank, by parameter name (module docstring)."""

    def __init__(self, tensors: CheckpointTensors, rank: int):
        self.tensors, self.rank = tensors, rank
        self.sources: dict[str, tuple[str, ...]] = {}  # kept weight → its checkpoint keys (concatenated rows)
        self.rules: dict[str, ShardRule] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # kept weight → its local shape
        self.dequantized: list[str] = []  # FP8 weights whose cut is off the blocks: loaded dequantized

    def choose(self, kept: Mapping[str, tuple[str, ...]], rules: Mapping[str, ShardRule]) -> None:
        """Keep in FP8 each weight of `kept` (name → its FP8 keys, `fp8_kept_sources`) whose rule (`rules`, by
        name; none: whole) cuts along the blocks; the others go to `dequantized`."""
        for name, keys in kept.items():
            shape = (sum(self.tensors.shapes[key][0] for key in keys), *self.tensors.shapes[keys[0]][1:])
            rule = rules.get(name)
            if rule is not None and not block_aligned(rule, shape):
                self.dequantized.append(name)
                continue
            self.sources[name] = keys
            self.shapes[name] = shape if rule is None else local_shape(rule, shape)
            if rule is not None:
                self.rules[name] = rule

    @property
    def kept(self) -> dict[str, tuple[str, ...]]:
        """What `fp8_linear.keep_fp8_linears` / `fill_fp8_linears` take: each kept weight under its own name."""
        return {name: (name,) for name in self.sources}

    def checkpoint_keys(self) -> set[str]:
        """The checkpoint keys read as kept FP8 weights (`load_weights`' `preloaded`)."""
        return {key for keys in self.sources.values() for key in keys}

    def is_fp8(self, name: str) -> bool:
        """Whether `name` is a weight kept in FP8."""
        return name in self.sources

    def read_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 e4m3 bytes, float32 scale_inv) of this rank's share of kept weight `name`: only its rows read."""
        keys, rule = self.sources[name], self.rules.get(name)
        if rule is None:
            return read_kept(keys, self.tensors)
        full = (sum(self.tensors.shapes[key][0] for key in keys), *self.tensors.shapes[keys[0]][1:])
        blocks = tuple(-(-n // FP8_BLOCK) for n in self.shapes[name])
        if rule.rank0_only and self.rank != 0:  # zero bytes decode to 0 whatever the scale
            return torch.zeros(self.shapes[name], dtype=torch.uint8), torch.ones(blocks)
        cuts = tuple(Cut(cut.dim % len(full), cut.pieces) for cut in rule.cuts)
        rows, rest = leading_rows(cuts)
        weight = read_rows_of_cat(keys, rows, rest, _Fp8Bytes(self.tensors))
        scale = apply_cuts(torch.cat([self.tensors.read_scale(key) for key in keys]), block_cuts(cuts, full))
        if rule.pad_rows:  # zero bytes; the padded rows' new blocks get scale 1
            weight = torch.cat([weight, weight.new_zeros((rule.pad_rows, *weight.shape[1:]))])
            scale = torch.cat([scale, scale.new_ones((blocks[0] - scale.shape[0], *scale.shape[1:]))])
        return weight, scale
