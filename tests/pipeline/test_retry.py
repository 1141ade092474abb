"""The driver's failure decisions against scripted events, without Ray: where a failed shard may run next, when a
worker is replaced, when a shard's deadline passes, when a worker counts as hung."""

from __future__ import annotations

import pytest

from jobs.generate import SECTIONS
from pipeline.cli import parse_sections
from pipeline.config import ScalingConfig
from pipeline.liveness import (
    FIRST_FORWARD_TIMEOUT_S,
    MIN_STALL_TIMEOUT_S,
    PROGRESS_INTERVAL_S,
    STALL_FACTOR,
    Heartbeats,
    Stop,
    Watch,
)
from pipeline.retry import MIN_SHARD_TIMEOUT_S, SHARD_TIMEOUT_FACTOR, RetryPolicy, ShardDeadline
from pipeline.sharding import Shard


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


def test_the_automatic_deadline_comes_from_what_is_known():
    deadline = ShardDeadline(max_num_seqs=64, max_tokens=255)
    assert deadline.timeout_for(10_000) is None  # nothing measured: no deadline yet (progress decides)
    # The worker's measured forward (0.5 s) × the forwards 10,000 rows need at most: 157 batches × 256 forwards.
    assert deadline.timeout_for(10_000, 0.5) == pytest.approx(SHARD_TIMEOUT_FACTOR * 157 * 256 * 0.5)
    assert deadline.timeout_for(10, 0.01) == MIN_SHARD_TIMEOUT_S  # a small, fast shard: the floor
    assert "the 20096 s its worker's forwards take for as many rows" in deadline.describe(10_000, 0.5)
    deadline.observe(num_rows=100, seconds=10.0)
    deadline.observe(num_rows=300, seconds=70.0)  # 0.2 s per row over both: measured rows win
    assert deadline.timeout_for(10_000, 0.5) == pytest.approx(SHARD_TIMEOUT_FACTOR * 10_000 * 0.2)  # 20,000 s
    assert deadline.deadline(10_000, started=5.0) == pytest.approx(5.0 + 20_000)
    assert "10 × the 2000 s this run's shards took for as many rows" in deadline.describe(10_000)


def _report(num_beats: int, longest_s: float = 0.5) -> dict:
    return {"num_beats": num_beats, "longest_s": longest_s, "mean_s": longest_s / 2}


def test_a_worker_that_keeps_reporting_progress_is_never_hung_however_long_its_shard():
    beats = Heartbeats()
    beats.busy("w", holding=True, now=0.0)
    assert beats.window("w") == FIRST_FORWARD_TIMEOUT_S  # its first forward may compile kernels, page weights in
    for step, now in enumerate(range(0, 10 * 3600, int(PROGRESS_INTERVAL_S))):  # ten hours of one shard
        beats.report("w", _report(step + 1), float(now))
        assert beats.hung(float(now) + 1) == []
    assert beats.window("w") == max(MIN_STALL_TIMEOUT_S, STALL_FACTOR * 0.5)
    last = float(now)
    assert beats.hung(last + MIN_STALL_TIMEOUT_S - 1) == []
    assert beats.hung(last + MIN_STALL_TIMEOUT_S + 1) == ["w"]  # it stopped reporting
    beats.report("w", _report(step + 1, longest_s=100.0), last + 10)  # the same count: no progress
    assert beats.window("w") == STALL_FACTOR * 100.0 and beats.hung(last + 999) == []  # a slower worker waits longer
    beats.busy("w", holding=False, now=last + 2000)
    assert beats.hung(last + 10**6) == []  # holds nothing: never hung


def _shards(*indices: int) -> list[tuple[Shard, float]]:
    return [(Shard(i, 8 * i, 8 * i + 8), 100.0 + i * 0.001) for i in indices]


def test_a_worker_past_a_fixed_deadline_with_several_shards_is_stopped_once_each_shard_charged_once():
    watch = Watch(timeout_s=30.0)
    held = {"frozen": _shards(0, 1, 2), "fine": [(Shard(3, 24, 32), 125.0)]}
    assert watch.check(held, now=129.0) == ([], [])
    stops, _ = watch.check(held, now=131.0)  # shards handed out together share a deadline to the millisecond
    assert stops == [
        Stop("frozen", frozenset({0, 1, 2}), "no result within 30 s (--shard-timeout-s); its worker was stopped")
    ]
    assert watch.to_poll(held, set(), 131.0) == []  # a fixed deadline needs no progress reports


def test_a_hung_worker_is_stopped_once_charging_the_shard_it_held_longest():
    watch = Watch(timeout_s=None)
    held = {"w": _shards(0, 1, 2), "idle": []}
    assert watch.to_poll(held, set(), 100.0) == ["w"]  # busy workers only, …
    assert watch.to_poll(held, {"w"}, 200.0) == []  # … one question at a time
    watch.check(held, now=100.0)
    watch.report("w", _report(5), now=101.0)
    stops, _ = watch.check(held, now=101.0 + MIN_STALL_TIMEOUT_S + 1)
    assert [(stop.worker, stop.charged) for stop in stops] == [("w", frozenset({0}))]
    assert "its worker made no progress for 301 s (auto: 10 × its longest forward, 0.5 s, at least 300 s" in (
        stops[0].reason
    )


def test_a_shard_past_its_expected_time_holds_its_worker_back_without_stopping_it():
    watch = Watch(timeout_s=None, max_num_seqs=8, max_tokens=7)
    held = {"w": _shards(0)}
    watch.check(held, now=100.0)
    watch.report("w", _report(1, longest_s=1.0), now=100.0)  # 0.5 s a forward: 8 rows, 8 forwards → 4 s
    for now in range(100, 2000, 5):  # it keeps making progress, far past MIN_SHARD_TIMEOUT_S
        watch.report("w", _report(now), now=float(now))
        stops, lines = watch.check(held, now=float(now))
        assert stops == []
        assert ("w" in watch.held_back) == (now > 100 + MIN_SHARD_TIMEOUT_S)
        said = [] if now != 705 else ["shard 0 has run 605 s, past its expected time"]
        assert [line.split(" (")[0] for line in lines] == said  # said once
    assert watch.check({"w": []}, now=2000.0) == ([], []) and not watch.held_back


def test_the_shards_one_failed_step_failed_count_once_against_their_worker():
    policy = RetryPolicy(max_shard_retries=3)
    assert not policy.shard_failed(0, "a", event="step-1").replace_worker
    assert not policy.shard_failed(1, "a", event="step-1").replace_worker  # the same step: one failure of "a"
    assert policy.worker_failures["a"] == 1 and policy.attempts[1] == 1
    assert policy.shard_failed(2, "a", event="step-2").replace_worker  # a second failure: replaced


def test_shard_timeout_flag_is_parsed_and_validated():
    assert ScalingConfig().shard_timeout_s is None  # auto
    base = ["--model", "m", "--input", "d.jsonl", "--prompt-column", "text"]
    assert parse_sections("t", SECTIONS, [*base, "--shard-timeout-s", "0"])["scaling"].shard_timeout_s == 0
    assert parse_sections("t", SECTIONS, [*base, "--shard-timeout-s", "90"])["scaling"].shard_timeout_s == 90.0
    for bad in (-1, "10", True):
        with pytest.raises(ValueError, match=r"--shard-timeout-s \(ScalingConfig.shard_timeout_s\)"):
            ScalingConfig(shard_timeout_s=bad)
