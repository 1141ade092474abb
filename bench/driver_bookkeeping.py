"""The driver's bookkeeping at scale, for `jobs/benchmark.py --task resume`: plan a job of many shards, prepare its
output, resume it over finished shard files and finalize it — no model, no Ray, no generation.

Every step is linear in the number of shards; these timings are how a regression to quadratic work shows (a resume
over 8,000 shards once took 1.9 s, one over 100,000 would have taken minutes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from pipeline.config import OutputConfig, ScalingConfig
from pipeline.job import Job
from pipeline.manifest import finalize_output, prepare_output
from pipeline.output import OutputDir
from pipeline.sharding import Shard, plan_shards
from workers.actor import WorkerSpec
from workers.sampling import SamplingParams


def synthetic_job(num_shards: int, output: str) -> Job:
    """A generate job of `num_shards` one-row shards over an in-memory dataset; nothing in it loads a model."""
    rows = datasets.Dataset.from_dict({"text": [""] * num_shards})
    return Job(
        name="generate",
        rows=rows,
        worker=WorkerSpec("generate", "synthetic", sampling=SamplingParams(seed=0)),
        task_fields=[],
        id_column=None,
        plan=plan_shards(num_shards, 1),
        scaling=ScalingConfig(rows_per_shard=1),
        output=OutputConfig(output),
        config={},
        fingerprint={"synthetic": num_shards},
    )


def shard_stats(shard: Shard) -> dict[str, Any]:
    """The stats a driver writes into a finished shard's file (as `ShardLoop` does), with made-up token counts."""
    return {
        "index": shard.index,
        "start": shard.start,
        "stop": shard.stop,
        "rows": shard.num_rows,
        "seconds": 1.0,
        "generated_tokens": 64,
    }


def write_finished_shards(out: OutputDir, plan: list[Shard]) -> None:
    """One small Parquet file per shard, carrying its stats in the footer as a finished shard's does."""
    for shard in plan:
        table = pa.table({"id": pa.array(range(shard.start, shard.stop), pa.int64())})
        out.write_table(shard.file_name, table, shard_stats(shard))


def _milliseconds(step: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = step()
    return (time.perf_counter() - start) * 1e3, value


def bench_resume(num_shards: int, directory: Path) -> dict[str, Any]:
    """Milliseconds per bookkeeping step of a `num_shards`-shard job writing to `directory` (empty or absent).

    plan: cut the rows into shards. prepare: check a new output and write its manifest (first run). write: one
    small file per shard (setup, shown for scale). resume: prepare again over every finished file. finalize_own:
    totals of a run that wrote every shard (nothing read back). finalize_resumed: totals after a resume, every
    shard's stats read back from its file's footer.
    """
    row: dict[str, Any] = {"num_shards": num_shards}
    row["plan_ms"], _ = _milliseconds(lambda: plan_shards(num_shards, 1))
    job = synthetic_job(num_shards, str(directory))
    out = OutputDir(str(directory))
    row["prepare_ms"], first = _milliseconds(lambda: prepare_output(out, job, overwrite=False))
    row["write_ms"], _ = _milliseconds(lambda: write_finished_shards(out, job.plan))
    written = {shard.index: shard_stats(shard) for shard in job.plan}
    row["finalize_own_ms"], _ = _milliseconds(lambda: finalize_output(out, job, 1.0, written))
    row["resume_ms"], resumed = _milliseconds(lambda: prepare_output(out, job, overwrite=False))
    if first.done or len(resumed.done) != num_shards:
        raise RuntimeError(
            f"prepare_output found {len(first.done)} then {len(resumed.done)} finished shards, "
            f"expected 0 then {num_shards}"
        )
    row["finalize_resumed_ms"], totals = _milliseconds(lambda: finalize_output(out, job, 1.0, {}))
    if totals["rows"] != num_shards:
        raise RuntimeError(f"finalize_output counted {totals['rows']} rows, expected {num_shards}")
    row["resume_us_per_shard"] = row["resume_ms"] / num_shards * 1e3
    return row
