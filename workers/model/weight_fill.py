"""Match a checkpoint's tensors to a model's parameters and fill them, the whole model or one rank's share."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from workers.model.checkpoint.tensors import CheckpointTensors, without_scales
from workers.model.checkpoint.weights import Source, checkpoint_sources, is_ignored
from workers.model.distributed.slices import ShardRule, qualified_rules
from workers.model.layers.hybrid import HybridModel
from workers.model.shard_reads import read_shard, read_source


def _pick(sources: list[Source], available: dict[str, Any]) -> Source | None:
    return next((s for s in sources if all(k in available for k in s.keys)), None)


def match_weights(
    model: HybridModel, shapes: dict[str, tuple[int, ...]], preloaded: Collection[str] = ()
) -> dict[str, Source]:
    """Parameter name → where it comes from, given the checkpoint's key → shape (its safetensors headers); the keys
    `preloaded` are read otherwise (FP8 kept: `layers/fp8_linear.py`).

    One `ValueError` listing every missing, extra or mis-shaped key; reads no tensor data.
    """
    config = model.config
    shapes = without_scales(shapes)  # an FP8 weight's block scales are read with it
    sources = checkpoint_sources(config, set(shapes))
    params = dict(model.named_parameters(remove_duplicate=False))
    if config.tie_word_embeddings:
        params.pop("lm_head.weight")
    problems, used = [], set(preloaded)
    plan = {}
    for name, param in params.items():
        options = sources.get(name, [])
        source = _pick(options, shapes)
        if source is None:  # name what is missing from the layout the checkpoint comes closest to
            closest = max(options, key=lambda s: sum(k in shapes for k in s.keys), default=None)
            wanted = [k for k in closest.keys if k not in shapes][:2] if closest else []
            problems.append(f"missing weight {wanted or name} for parameter {name!r} of shape {tuple(param.shape)}")
            continue
        used.update(source.keys)
        plan[name] = source
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # a tied checkpoint may still carry a copy
    for key in sorted(set(shapes) - used):
        if not is_ignored(key):
            problems.append(f"unexpected weight {key!r} with shape {tuple(shapes[key])} in the checkpoint")
    for name, source in plan.items():
        plain = source.combine == "one" and source.transform is None
        expected = source.shapes or ((tuple(params[name].shape),) if plain else ())
        for key, shape in zip(source.keys, expected):
            found = tuple(shapes[key])
            if found != tuple(shape):
                problems.append(f"weight {key!r} has shape {found} in the checkpoint, model expects {tuple(shape)}")
        if source.cat_shape is not None:
            found = [tuple(shapes[key]) for key in source.keys]
            joined = (sum(shape[0] for shape in found), *found[0][1:]) if found else ()
            if any(shape[1:] != found[0][1:] for shape in found) or joined != tuple(source.cat_shape):
                problems.append(
                    f"weights {list(source.keys)} have shapes {found} in the checkpoint; concatenated "
                    f"they must give {tuple(source.cat_shape)}"
                )
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"checkpoint does not match the {config.model_type} architecture:\n  {shown}")
    return plan


@dataclass(frozen=True)
class Sharding:
    """How one tensor-parallel rank fills its local model: the full model (on the meta device) the checkpoint is
    matched against, each local parameter's rule (`parameter_rules`), and the rank."""

    reference: HybridModel
    rules: dict[str, ShardRule]
    rank: int


def parameter_rules(model: torch.nn.Module) -> dict[str, ShardRule]:
    """Every parameter name of `model` (each name of a shared parameter too) → the rule its module states
    (`qualified_rules`); `ValueError` for a rule naming no parameter or buffer of `model`."""
    rules = qualified_rules(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unknown = sorted(name for name in rules if name not in params and name not in buffers)
    if unknown:
        raise ValueError(f"shard rules name parameters the model does not have: {', '.join(unknown[:5])}")
    by_tensor = {id(params[name]): rule for name, rule in rules.items() if name in params}
    return {name: by_tensor[id(param)] for name, param in params.items() if id(param) in by_tensor}


def load_weights(
    model: HybridModel,
    tensors: CheckpointTensors,
    prepare: Callable[[torch.nn.Module], Any] | None = None,
    preloaded: Collection[str] = (),
    sharding: Sharding | None = None,
) -> None:
    """Fill every parameter from the checkpoint; one `ValueError` listing every missing, extra or mis-shaped key.

    `prepare(block)` is called on each block as soon as its parameters are filled (the loader packs or quantizes
    its linears there), so that the checkpoint's layout of one block at a time, not of the whole model, is held
    beside the packed weights. `sharding`: `model` is one rank's share; the checkpoint is matched against the full
    model and each parameter with a rule is read with `read_shard` (only the rank's rows where the layout allows)."""
    plan = match_weights(model if sharding is None else sharding.reference, dict(tensors.shapes), preloaded)
    params = dict(model.named_parameters(remove_duplicate=False))
    plan = {name: source for name, source in plan.items() if name in params}  # FP8 kept weights: filled already
    blocks: dict[str, list[str]] = {}  # block prefix → its parameters, in plan order
    for name in plan:
        if name.startswith("blocks."):
            blocks.setdefault(_block_of(name), []).append(name)
    with torch.no_grad():
        for name, source in plan.items():
            _fill(params[name], name, source, tensors, sharding)
            block = _block_of(name)
            if prepare is not None and block in blocks and name == blocks[block][-1]:
                for done in blocks[block]:  # no reference left to the weights `prepare` replaces
                    params.pop(done)
                prepare(model.get_submodule(block))


def _fill(
    param: torch.Tensor, name: str, source: Source, tensors: CheckpointTensors, sharding: Sharding | None
) -> None:
    """Read `name`'s share (all of it without a rule) into `param`."""
    rule = None if sharding is None else sharding.rules.get(name)
    plain = source.combine == "one" and source.transform is None
    if rule is None and plain and tensors.read_into(source.keys[0], param.data):
        return
    if rule is None:
        tensor = read_source(source, tensors)
    elif plain and _rows_only(rule):  # the rank's rows, read straight into the parameter where it fits
        data = param.data
        tensor = tensors.read_rows(source.keys[0], rule.cuts[0].pieces, data)
        if tensor is data:
            return
    else:
        full_shape = sharding.reference.get_parameter(name).shape
        tensor = read_shard(source, rule, sharding.rank, tensors, full_shape)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"weight {source.keys} has combined shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
            + ("" if sharding is None else f" (rank {sharding.rank}, rule {rule})")
        )
    param.data.copy_(tensor)


def _rows_only(rule: ShardRule) -> bool:
    """Whether `rule` only keeps some rows (one cut of dim 0, nothing padded or zeroed)."""
    return len(rule.cuts) == 1 and rule.cuts[0].dim == 0 and not rule.pad_rows and not rule.rank0_only


def _block_of(name: str) -> str:
    """'blocks.3' for 'blocks.3.mixer.in_proj.weight'."""
    return ".".join(name.split(".")[:2])
