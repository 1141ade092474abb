"""Resume bookkeeping at scale: planning and resuming 100,000 shards takes seconds (no model, no Ray)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pipeline.benchmark import synthetic_job
from pipeline.manifest import prepare_output
from pipeline.output import OutputDir

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
