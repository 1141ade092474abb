"""Deterministic shard plan: contiguous row ranges, identical for the same input size and flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_DEFAULT_ROWS_PER_SHARD = 64
MAX_DEFAULT_ROWS_PER_SHARD = 10_000
TARGET_NUM_SHARDS = 32


@dataclass(frozen=True)
class Shard:
    """Rows [start, stop) of the input, written to one Parquet file."""

    index: int
    start: int
    stop: int

    @property
    def file_name(self) -> str:
        """The shard's output file, `part-00000.parquet` …"""
        return f"part-{self.index:05d}.parquet"

    @property
    def num_rows(self) -> int:
        """Rows in the shard."""
        return self.stop - self.start


def default_rows_per_shard(num_rows: int) -> int:
    """About 32 shards, each between 64 and 10,000 rows: enough to spread over workers and to resume cheaply."""
    wanted = math.ceil(num_rows / TARGET_NUM_SHARDS)
    return max(MIN_DEFAULT_ROWS_PER_SHARD, min(MAX_DEFAULT_ROWS_PER_SHARD, wanted))


def plan_shards(num_rows: int, rows_per_shard: int | None = None) -> list[Shard]:
    """Cut rows 0 … num_rows-1 into contiguous shards of `rows_per_shard` (the last one may be shorter)."""
    size = rows_per_shard or default_rows_per_shard(num_rows)
    return [Shard(i, start, min(start + size, num_rows)) for i, start in enumerate(range(0, num_rows, size))]
