"""Shards streaming through one worker: the next shard's rows join the batch before the current shard drains, each
shard's results equal a call of its own, a failing step fails only the shards whose rows it ran, rows are decoded
and tokenized only as the engine takes them, and the heartbeat counts the engine's work."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from workers.actor import ShardTask, ShardWorker, WorkerSpec
from workers.config import EngineConfig
from workers.rows import PromptSource
from workers.sampling import SamplingParams
from workers.stream import ROWS_AHEAD_PER_SEQ

WORDS = ["the", "cat", "a", "dog", "sat", "on", "mat", "ran"]


def _shard(index: int, num_rows: int) -> ShardTask:
    rng = random.Random(index)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 12))) for _ in range(num_rows)]
    return ShardTask(index, index * num_rows, pa.table({"text": texts}))


@pytest.fixture
def worker(checkpoint_dir):
    spec = WorkerSpec(
        "generate",
        str(checkpoint_dir("granite_moe")),
        EngineConfig().replace(max_num_seqs=4, dtype="auto"),
        prompt=PromptSource(prompt_column="text"),
        sampling=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
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

    return [worker.spec.sampling] * shard.rows.num_rows


def test_a_failing_step_fails_only_the_shards_it_ran_and_the_others_go_on(worker):
    """Two shards of 6 rows through 4 slots: the third step runs rows of the first shard only (the second's wait
    for slots) and raises, as a transient out-of-memory would. Only the shard it ran fails (with the step's error,
    once); the other finishes with what an undisturbed run gives; the worker serves the next shard."""
    runner = worker.runner
    engine = runner._engine()
    step, calls, ran = engine.step, [], set()

    def failing_once():
        calls.append(1)
        if len(calls) == 3:
            ran.update(runner._request_keys[r.index][0] for r in engine.prefilling + engine.running)
            raise RuntimeError("injected step failure")
        step()

    engine.step = failing_once
    shards = [_shard(i, 6) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(worker.process, shard) for shard in shards]
        errors = [f.exception() for f in futures]
    assert len(ran) == 1  # 4 slots, 6 rows a shard: the step ran one shard's rows
    (blamed,) = ran
    assert isinstance(errors[blamed], RuntimeError) and "injected step failure" in str(errors[blamed])
    other = 1 - blamed
    assert errors[other] is None
    alone = ShardWorker(worker.spec)
    expected = alone.runner.generate(
        [alone.runner.tokenizer.encode(t) for t in shards[other].rows.column("text").to_pylist()],
        _params(worker, shards[other]),
    )
    assert futures[other].result().columns["generated_token_ids"] == [r.token_ids for r in expected]
    output = worker.process(_shard(5, 6))  # a fresh engine serves the next shard
    assert output.columns["error"] == [None] * 6 and len(output.columns["generated_token_ids"][0]) == 12


def test_rows_are_tokenized_as_the_engine_takes_them(worker):
    """A 40-row shard through 4 slots: the engine never holds more than ROWS_AHEAD_PER_SEQ × 4 rows, and no more are
    tokenized (before, the whole shard was tokenized ahead of its first step: the token ids of every shard in flight
    sat outside --max-memory)."""
    runner = worker.runner
    engine, encode, encoded, held = runner._engine(), runner.tokenizer.encode, [], []
    step = engine.step

    def counting_encode(text, *args, **kwargs):
        encoded.append(text)
        return encode(text, *args, **kwargs)

    def recorded():
        held.append((len(encoded), len(runner._request_keys)))
        step()

    runner.tokenizer.encode, engine.step = counting_encode, recorded
    output = worker.process(_shard(0, 40))
    assert output.columns["error"] == [None] * 40 and len(encoded) == 40
    bound = ROWS_AHEAD_PER_SEQ * worker.spec.max_num_seqs
    assert held[0][0] <= bound  # tokenized before the first step
    assert max(in_engine for _, in_engine in held) <= bound  # added to the engine and not yet returned


def test_the_heartbeat_counts_the_engines_work_and_stands_still_while_it_waits(worker):
    before = worker.progress()
    worker.process(_shard(0, 6))
    after = worker.progress()
    assert after["num_beats"] >= before["num_beats"] + 12  # 12 tokens a row: at least as many steps
    assert 0 < after["mean_s"] <= after["longest_s"]
    time.sleep(0.2)
    assert worker.progress() == after  # idle: nothing moves, and the wait is not counted as work
