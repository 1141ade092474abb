"""Resume bookkeeping at scale: planning and resuming 100,000 shards takes seconds, and finalizing reads back only the
shard files of earlier runs (no model, no Ray)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench.driver_bookkeeping import shard_stats, synthetic_job, write_finished_shards
from pipeline.manifest import finalize_output, prepare_output
from pipeline.output import MANIFEST, OutputDir

NUM_SHARDS = 100_000
BOUND_S = 15.0  # each step takes ~1-2 s on a 2-core machine; the quadratic resume took ~10 minutes


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail the test as soon as the block has run `seconds` (a quadratic regression fails fast, not in minutes)."""

    def expire(signum: int, frame: object) -> None:
        pytest.fail(f"{what} took over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
def test_planning_and_resuming_100k_shards_takes_seconds(tmp_path):
    with deadline(BOUND_S, f"planning {NUM_SHARDS} shards and preparing their output"):
        job = synthetic_job(NUM_SHARDS, str(tmp_path))
        out = OutputDir(str(tmp_path))
        assert prepare_output(out, job, overwrite=False).done == set()
    for shard in job.plan:  # finished shards, as far as resuming looks: it lists names
        (tmp_path / shard.file_name).touch()
    with deadline(BOUND_S, f"resuming over {NUM_SHARDS} finished shards"):
        resumed = prepare_output(out, job, overwrite=False)
    assert resumed.done == set(range(NUM_SHARDS))


def test_finalize_reads_back_only_the_shards_of_earlier_runs(tmp_path):
    job = synthetic_job(4, str(tmp_path))
    out = OutputDir(str(tmp_path))
    prepare_output(out, job, overwrite=False)
    write_finished_shards(out, job.plan[:2])  # a first run wrote two shards, then crashed
    assert prepare_output(out, job, overwrite=False).done == {0, 1}
    for shard in job.plan[2:]:  # this run's: unreadable placeholders, so reading one back fails the test
        (tmp_path / shard.file_name).touch()
    totals = finalize_output(out, job, 2.0, {shard.index: shard_stats(shard) for shard in job.plan[2:]})
    assert (totals["rows"], totals["generated_tokens"], totals["untimed_shards"]) == (4, 4 * 64, 2)
    run = json.loads((tmp_path / MANIFEST).read_text())["runs"][-1]
    assert (run["shards_written"], run["rows"], run["generated_tokens"]) == (2, 2, 2 * 64)
