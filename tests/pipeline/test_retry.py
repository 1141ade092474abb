"""The driver's failure decisions against scripted events, without Ray: where a failed shard may run next, when a
worker is replaced, when a shard's deadline passes."""

from __future__ import annotations

import pytest

from jobs.generate import SECTIONS
from pipeline.cli import parse_sections
from pipeline.config import ScalingConfig
from pipeline.retry import (
    FIRST_SHARD_TIMEOUT_S,
    MIN_SHARD_TIMEOUT_S,
    SHARD_TIMEOUT_FACTOR,
    RetryPolicy,
    ShardDeadline,
)


def test_failed_shard_goes_to_another_ready_worker_and_the_failed_one_takes_other_work():
    policy = RetryPolicy(max_shard_retries=3)
    ready = {"a", "b"}
    failure = policy.shard_failed(2, "a")
    assert (failure.retry, failure.replace_worker, failure.attempts) == (True, False, 1)
    queue = [2, 3]  # the failed shard is requeued at the front
    assert policy.next_shard("a", queue, ready) == 1  # a skips shard 2 and takes shard 3
    assert policy.next_shard("b", queue, ready) == 0  # b takes shard 2
    assert policy.next_shard("a", [2], ready) is None  # nothing a may take: it waits, shard 2 waits for b


def test_failed_shard_returns_to_its_worker_only_when_no_other_ready_worker_is_left():
    policy = RetryPolicy(max_shard_retries=3)
    policy.shard_failed(2, "a")
    assert policy.next_shard("a", [2], ready_workers={"a"}) == 0  # the only ready worker (others still starting)
    policy.shard_failed(2, "b")
    assert policy.next_shard("a", [2], ready_workers={"a", "b"}) == 0  # failed on every ready worker
    assert policy.next_shard("a", [2], ready_workers={"a", "b", "c"}) is None  # c has not tried it


def test_worker_failing_twice_is_replaced_and_shard_retries_are_bounded():
    policy = RetryPolicy(max_shard_retries=1)
    assert not policy.shard_failed(2, "a").replace_worker
    second = policy.shard_failed(3, "a")  # a broken worker fails whatever it gets
    assert second.replace_worker and second.retry
    assert not policy.shard_failed(2, "b").retry  # shard 2's second failure: past --max-shard-retries 1
    lost = policy.shard_failed(4, None)  # a worker that died: the shard's retry counts, no worker to blame
    assert (lost.retry, lost.replace_worker, lost.attempts) == (True, False, 1)
    policy.forget_worker("a")
    assert policy.worker_failures["a"] == 0


def test_fixed_and_disabled_shard_timeouts():
    assert ShardDeadline(timeout_s=30.0).deadline(num_rows=8, started=100.0) == 130.0
    assert ShardDeadline(timeout_s=0.0).deadline(num_rows=8, started=100.0) is None  # 0 = no deadline
    assert ShardDeadline(timeout_s=30.0).describe(8) == "--shard-timeout-s"


def test_automatic_timeout_follows_measured_throughput_with_floors():
    deadline = ShardDeadline()
    assert deadline.timeout_for(1000) == FIRST_SHARD_TIMEOUT_S  # nothing measured yet: the generous first floor
    assert "no shard has finished yet" in deadline.describe(1000)
    deadline.observe(num_rows=100, seconds=10.0)
    deadline.observe(num_rows=300, seconds=70.0)  # 0.2 s per row over both
    assert deadline.timeout_for(10_000) == pytest.approx(SHARD_TIMEOUT_FACTOR * 10_000 * 0.2)  # 20,000 s
    assert deadline.timeout_for(10) == MIN_SHARD_TIMEOUT_S  # a small shard: the floor
    assert deadline.deadline(10_000, started=5.0) == pytest.approx(5.0 + 20_000)
    assert "10 × the 2000 s this run's shards took for as many rows" in deadline.describe(10_000)


def test_shard_timeout_flag_is_parsed_and_validated():
    assert ScalingConfig().shard_timeout_s is None  # auto
    base = ["--model", "m", "--input", "d.jsonl", "--prompt-column", "text"]
    assert parse_sections("t", SECTIONS, [*base, "--shard-timeout-s", "0"])["scaling"].shard_timeout_s == 0
    assert parse_sections("t", SECTIONS, [*base, "--shard-timeout-s", "90"])["scaling"].shard_timeout_s == 90.0
    for bad in (-1, "10", True):
        with pytest.raises(ValueError, match=r"--shard-timeout-s \(ScalingConfig.shard_timeout_s\)"):
            ScalingConfig(shard_timeout_s=bad)
