"""The driver's failure decisions against scripted events, without Ray: where a failed shard may run next, when a
worker is replaced."""

from __future__ import annotations

from pipeline.retry import RetryPolicy


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
