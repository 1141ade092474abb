"""Shards streaming through one worker: the next shard's rows join the batch before the current shard drains, each
shard's results equal a call of its own, and a failing step fails only the shards in flight."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from workers.actor import ShardTask, ShardWorker, WorkerSpec
from workers.rows import PromptSource

WORDS = ["the", "cat", "a", "dog", "sat", "on", "mat", "ran"]


def _shard(index: int, num_rows: int) -> ShardTask:
    rng = random.Random(index)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 12))) for _ in range(num_rows)]
    return ShardTask(index, index * num_rows, pa.table({"text": texts}))


@pytest.fixture
def worker(checkpoint_dir):
    spec = WorkerSpec("generate", str(checkpoint_dir("granite_moe")), max_num_seqs=4,
                      prompt=PromptSource(prompt_column="text"),
                      task_options=dict(temperature=0, max_tokens=12, ignore_eos=True))  # fmt: skip
    worker = ShardWorker(spec)
    assert worker.start_error is None
    return worker


def _live_shards(worker: ShardWorker, seen: list[set[int]], sizes: list[int]):
    """Wrap the engine's step to record which shards had rows in the batch at each step, and how many rows."""
    runner = worker.runner
    engine = runner._engine()
    admit = engine._admit

    def recorded():
        admit()
        live = engine.prefilling + engine.running
        seen.append({runner._request_keys[r.index][0] for r in live})
        sizes.append(len(live))

    engine._admit = recorded


def test_the_next_shards_rows_enter_before_the_current_shard_drains(worker):
    """Shards of 5 rows through 4 slots: a shard's last rows share the batch with the next shard's first (one
    call per shard would run them alone), and the batch stays full until the last shard's tail."""
    seen: list[set[int]] = []
    sizes: list[int] = []
    _live_shards(worker, seen, sizes)
    shards = [_shard(i, 5) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        outputs = list(pool.map(worker.process, shards))
    assert [o.index for o in outputs] == [0, 1, 2]
    assert any({0, 1} <= live for live in seen) and any({1, 2} <= live for live in seen)
    first_drop = next(i for i, n in enumerate(sizes) if n < 4)
    assert all(n < 4 for n in sizes[first_drop:]) and set(seen[first_drop]) == {2}


def test_streamed_shards_equal_one_call_per_shard(worker, checkpoint_dir):
    shards = [_shard(i, 6) for i in range(4)]
    with ThreadPoolExecutor(2) as pool:
        streamed = list(pool.map(worker.process, shards))
    alone = ShardWorker(worker.spec)
    for shard, output in zip(shards, streamed):
        expected = alone.runner.generate(
            [alone.runner.tokenizer.encode(t) for t in shard.rows.column("text").to_pylist()],
            [p for p in _params(worker, shard)],
        )
        assert output.columns["generated_token_ids"] == [r.token_ids for r in expected]
        assert output.stats["generated_tokens"] == sum(len(r.token_ids) for r in expected)


def _params(worker: ShardWorker, shard: ShardTask):
    from workers.sampling import SamplingParams

    return [SamplingParams(**worker.spec.task_options)] * shard.rows.num_rows


def test_a_failing_step_fails_the_shards_in_flight_and_the_worker_goes_on(worker):
    engine = worker.runner._engine()
    step, calls = engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        step()

    engine.step = failing_once
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(worker.process, _shard(i, 6)) for i in range(2)]
        errors = [f.exception() for f in futures]
    assert all(isinstance(e, RuntimeError) and "injected" in str(e) for e in errors)
    output = worker.process(_shard(5, 6))  # a fresh engine serves the next shard
    assert output.columns["error"] == [None] * 6 and len(output.columns["generated_token_ids"][0]) == 12
