"""The Ray Data stage on a local Ray: every row once, a bad row's `error`, output equal to `jobs/generate.py`'s on
the same rows (greedy, and seeded sampling), `preprocess` / `postprocess` applied, bad configs refused up front."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline import HybridgenProcessorConfig, build_processor
from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.ray_data import GenerateStage, actor_options, stage_spec
from tests.pipeline.conftest import job_config, read_output
from tests.tiny_models import WORDS
from workers import ModelRunner, SamplingParams

pytestmark = pytest.mark.slow

NUM_ROWS = 24
BAD_ROWS = {4: "", 13: " ".join(["cat"] * 60)}  # empty; longer than max_model_len
COMPARED = [
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "num_generated_tokens",
    "num_prompt_tokens",
    "error",
]


def texts() -> list[str]:
    rng = random.Random(1)
    words = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(NUM_ROWS)]
    return [BAD_ROWS.get(i, text) for i, text in enumerate(words)]


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"key": f"row-{i:03d}", "text": t}) + "\n" for i, t in enumerate(texts())))
    return path


def job_output(model: Path, data: Path, output: Path, **sampling) -> dict[str, dict]:
    """The generate job's output rows by id (8-row shards)."""
    assert run(build_generate_job(job_config(model, data, output, **sampling)))["rows"] == NUM_ROWS
    return {row["id"]: row for row in read_output(output)}


def stage_output(model: Path, sampling: dict, engine_kwargs: dict | None = None, **options) -> list[dict]:
    """The stage's output rows over {index, key, question} rows, `preprocess` naming the prompt column."""
    import ray

    config = HybridgenProcessorConfig(
        model_source=str(model),
        engine_kwargs={"max_model_len": 40, "max_num_seqs": 8, **(engine_kwargs or {})},
        sampling_params={"max_tokens": 6, "ignore_eos": True, **sampling},
        prompt_column="text",
        batch_size=5,
        **options,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {**row, "text": row["question"]},
        postprocess=lambda row: {**row, "answer_chars": len(row["generated_text"] or "")},
    )
    rows = [{"index": i, "key": f"row-{i:03d}", "question": t} for i, t in enumerate(texts())]
    return processor(ray.data.from_items(rows, override_num_blocks=4)).take_all()


def assert_same_as_job(stage: list[dict], job: dict[str, dict]) -> None:
    assert sorted(row["key"] for row in stage) == sorted(job)  # every row once, no duplicate
    for row in stage:
        expected = job[row["key"]]
        assert {c: _plain(row[c]) for c in COMPARED} == {c: expected[c] for c in COMPARED}, row["key"]


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(concurrency=(2, 1)), r"concurrency=\(2, 1\) is invalid: must be an integer ≥ 1 or a tuple \(min, max\)"),
        (dict(concurrency=0), "concurrency=0 is invalid"),
        (dict(batch_size=0), "batch_size=0 is invalid"),
        (dict(prompt_column=None), "exactly one of them"),
        (dict(sampling_params={"temperature": -1}), "temperature"),
        (dict(sampling_params={"seed": 3}), "index_column=None is invalid"),
        (dict(engine_kwargs={"max_num_seq": 8}), "'max_num_seq' is not an engine option"),
        (dict(engine_kwargs={"max_num_seqs": 0}), "max_num_seqs=0 is invalid"),
        (dict(model_source="/nonexistent/model"), "/nonexistent/model"),
    ],
)
def test_a_bad_config_is_refused_when_the_processor_is_built(model, options, message):
    """Refused by `build_processor`, with no Ray and no dataset: no actor can have started."""
    import ray

    assert not ray.is_initialized()
    with pytest.raises((ValueError, TypeError), match=message):
        build_processor(HybridgenProcessorConfig(**{"model_source": str(model), **options}))
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def greedy_job(model, dataset, tmp_path_factory, local_ray) -> dict[str, dict]:
    return job_output(model, dataset, tmp_path_factory.mktemp("job"), temperature=0.0, num_workers=1)


def test_every_row_once_equal_to_the_generate_job_with_pre_and_postprocess(model, greedy_job):
    stage = stage_output(model, {"temperature": 0.0}, concurrency=(1, 2))
    assert_same_as_job(stage, greedy_job)
    errors = {row["index"]: row["error"] for row in stage if row["error"]}
    assert set(errors) == set(BAD_ROWS)
    assert errors[4] == "prompt text is empty"
    assert "more than max_model_len=40" in errors[13]
    for row in stage:  # preprocess's column and the input's are carried; postprocess's is added
        assert row["text"] == row["question"] == texts()[row["index"]]
        assert row["answer_chars"] == len(row["generated_text"] or "")
    good = [row for row in stage if not row["error"]]
    assert all(row["finish_reason"] == "length" and row["num_generated_tokens"] == 6 for row in good)


def test_seeded_sampling_uses_the_index_column_as_the_job_uses_the_row_number(model, greedy_job):
    """Row i of the generate job samples with seed + i (its `shard_requests`): here the runner runs that rule itself,
    one request per good row; the stage, given the row number as `index_column`, must sample the same."""
    stage = stage_output(model, {"temperature": 1.0, "seed": 7}, concurrency=2, index_column="index")
    runner = ModelRunner.from_pretrained(str(model), max_model_len=40, max_num_seqs=8)
    good = [i for i, text in enumerate(texts()) if i not in BAD_ROWS]
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True) for i in good]
    direct = runner.generate([runner.tokenizer.encode(texts()[i]) for i in good], params)
    by_index = {row["index"]: row for row in stage}
    assert sorted(by_index) == list(range(NUM_ROWS)) and len(stage) == NUM_ROWS
    assert [_plain(by_index[i]["generated_token_ids"]) for i in good] == [r.token_ids for r in direct]
    assert [by_index[i]["generated_text"] for i in good] == [r.text for r in direct]
    greedy = [greedy_job[f"row-{i:03d}"]["generated_token_ids"] for i in good]
    assert [r.token_ids for r in direct] != greedy  # it did sample


def test_a_worker_split_over_two_ranks_writes_what_the_job_writes(model, greedy_job):
    """`tensor_parallel_size` 2 on CPU: the actor's runner starts its follower rank process itself."""
    stage = stage_output(model, {"temperature": 0.0}, engine_kwargs={"tensor_parallel_size": 2})
    assert_same_as_job(stage, greedy_job)


def test_actors_ask_for_a_gpu_and_the_cpus_of_each_rank(model):
    config = HybridgenProcessorConfig(
        model_source=str(model), engine_kwargs={"device": "cuda", "tensor_parallel_size": 2}, num_cpus=3
    )
    assert actor_options(config, stage_spec(config)) == {"num_cpus": 6, "num_gpus": 2}
    config = dataclasses.replace(config, engine_kwargs={"device": "cpu"}, runtime_env={"env_vars": {"A": "1"}})
    assert actor_options(config, stage_spec(config)) == {
        "num_cpus": 3,
        "num_gpus": 0,
        "runtime_env": {"env_vars": {"A": "1"}},
    }


def test_overlapping_batches_of_one_actor_share_its_engine_steps(model):
    """The UDF class without Ray, called on two threads as Ray Data's threaded actor calls it: two 4-row batches
    run in the same engine steps as one 8-row batch (the actor does not drain one batch before the next), and each
    call gets its own rows back."""
    config = HybridgenProcessorConfig(
        model_source=str(model),
        engine_kwargs={"max_model_len": 40, "max_num_seqs": 8},
        sampling_params={"max_tokens": 6, "ignore_eos": True, "temperature": 0.0},
    )
    spec = stage_spec(config)
    table = pa.table({"prompt": [text for i, text in enumerate(texts()) if i not in BAD_ROWS][:8]})
    whole = GenerateStage(spec)
    expected = whole(table)
    split = GenerateStage(spec)
    stream, holding, release = split.worker.stream, threading.Event(), threading.Event()
    submitted, submit = threading.Semaphore(0), stream.submit
    stream.submit = lambda *args, **kwargs: (submit(*args, **kwargs), submitted.release())[0]
    stream.call(lambda: (holding.set(), release.wait()))  # holds the engine thread until both batches are queued
    assert holding.wait(30)
    with ThreadPoolExecutor(2) as pool:
        halves = pool.map(split, [table.slice(0, 4), table.slice(4)])
        try:
            both = submitted.acquire(timeout=10) and submitted.acquire(timeout=10)
            assert both, "the second batch was not submitted while the first one was waiting for the engine"
        finally:
            release.set()
        got = pa.concat_tables(list(halves))
    assert got.to_pylist() == expected.to_pylist()
    assert stream.heartbeat.num_beats == whole.worker.stream.heartbeat.num_beats
