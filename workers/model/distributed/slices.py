"""How one rank's parameter is cut from the checkpoint's full tensor: the rule a layer states, the loader applies.

A layer built for tensor parallelism knows which rows and columns of each of its weights it holds (it chose the
split), so it says so: a module with a `shard_rules()` method returns `{local parameter name: ShardRule}` (names
relative to the module, e.g. `"in_proj.weight"`). The loader walks the model's modules, qualifies the names, and
cuts each full checkpoint tensor by its rule; a parameter no module names is replicated whole. The layer tests cut a
full layer's state dict by the same rules, so the layer, its test and the loader cannot disagree.

A rule is a sequence of cuts, each along one dimension: the listed `(start, length)` pieces of the full tensor,
concatenated (Mamba2's in_proj rows are five pieces: z, x, B, C, dt of this rank). After the cuts, `pad_rows` zero
rows may be appended along dim 0 (the last vocabulary shard), and `rank0_only` zeroes the tensor on ranks other
than 0 (the bias of a row-parallel linear, whose outputs the ranks sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cut:
    """The pieces `(start, length)` of the full tensor along `dim` that this rank keeps, in order."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        """The local size along `dim`."""
        return sum(length for _, length in self.pieces)


@dataclass(frozen=True)
class ShardRule:
    """How a rank's parameter comes from the full one; the default replicates it whole."""

    cuts: tuple[Cut, ...] = ()
    pad_rows: int = 0  # zero rows appended along dim 0 after the cuts
    rank0_only: bool = False  # zero on every rank but 0 (a row-parallel bias: the ranks' outputs are summed)

    def apply(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's tensor, cut from `full` (a new tensor; `full` is not changed)."""
        local = full
        for cut in self.cuts:
            local = torch.cat([local.narrow(cut.dim, start, length) for start, length in cut.pieces], dim=cut.dim)
        if self.pad_rows:
            local = torch.cat([local, local.new_zeros((self.pad_rows, *local.shape[1:]))])
        local = local.clone() if local is full else local
        return local.zero_() if self.rank0_only and rank != 0 else local


REPLICATED = ShardRule()


def rows(*pieces: tuple[int, int], dim: int = 0, rank0_only: bool = False) -> ShardRule:
    """Keep these pieces of dim `dim` (0: a weight's output rows, a bias, a conv's channels)."""
    return ShardRule((Cut(dim, tuple(pieces)),), rank0_only=rank0_only)


def columns(*pieces: tuple[int, int], dim: int = 1) -> ShardRule:
    """Keep these pieces of a weight's input columns (a row-parallel linear's weight)."""
    return ShardRule((Cut(dim, tuple(pieces)),))


def cut_state_dict(module: torch.nn.Module, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """`full` (a state dict of the unsplit model or layer) cut for `module`, a rank's copy built with its
    `TensorParallel`: every name a submodule's `shard_rules()` states is cut by its rule, the rest kept whole."""
    rules = qualified_rules(module)
    return {name: rules.get(name, REPLICATED).apply(tensor, rank) for name, tensor in full.items()}


def qualified_rules(module: torch.nn.Module) -> dict[str, ShardRule]:
    """Every rule the submodules of `module` state, by qualified parameter name; `ValueError` on a name two
    modules both claim."""
    rules: dict[str, ShardRule] = {}
    for prefix, sub in module.named_modules():
        stated = getattr(sub, "shard_rules", None)
        if stated is None:
            continue
        for name, rule in stated().items():
            qualified = f"{prefix}.{name}" if prefix else name
            if qualified in rules:
                raise ValueError(f"parameter {qualified} has two shard rules")
            rules[qualified] = rule
    return rules
