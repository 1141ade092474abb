"""Tensor and expert parallelism inside a worker: the rank group's collectives and how a model splits over it."""

from workers.model.distributed.group import SINGLE, Collectives, RankFailure, make_group
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, check_divisible, shard_config

__all__ = [
    "SINGLE",
    "SINGLE_TP",
    "Collectives",
    "RankFailure",
    "TensorParallel",
    "check_divisible",
    "make_group",
    "shard_config",
]
