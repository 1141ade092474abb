"""`--n` samples per row through the job: one output row per sample, every (id, sample_index) pair exactly once
across a worker crash and a driver crash with its resume, the samples the runner gives, n in the fingerprint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.output import OutputRefused
from tests.pipeline.conftest import BAD_ROWS, NUM_ROWS, job_argv, job_config, read_output
from workers import ModelRunner, SamplingParams, sample_seed

pytestmark = pytest.mark.slow

N, SEED = 3, 123
SAMPLING = dict(n=N, temperature=0.8, seed=SEED)


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


@pytest.fixture(scope="module")
def undisturbed(model, dataset, tmp_path_factory, ray_session) -> list[dict]:
    output = tmp_path_factory.mktemp("undisturbed")
    totals = run(build_generate_job(job_config(model, dataset, output, **SAMPLING)))
    assert totals["rows"] == NUM_ROWS * N
    schema = pq.read_schema(next(output.glob("part-*.parquet")))
    assert schema.field("sample_index").type == pa.int32()
    return read_output(output)


def _pairs(rows: list[dict]) -> list[tuple[str, int]]:
    return [(row["id"], row["sample_index"]) for row in rows]


def test_one_row_per_sample_equal_to_the_runner(model, undisturbed):
    assert _pairs(undisturbed) == [(f"row-{i:03d}", j) for i in range(NUM_ROWS) for j in range(N)]
    errors = [row for row in undisturbed if row["error"]]
    assert sorted({int(row["id"][4:]) for row in errors}) == sorted(BAD_ROWS) and len(errors) == N * len(BAD_ROWS)
    # Row i's sample j is its prompt run alone with sample_seed(seed + i, j).
    runner = ModelRunner.from_pretrained(str(model), max_model_len=40)
    for row in [r for r in undisturbed if not r["error"]][:12]:
        i, j = int(row["id"][4:]), row["sample_index"]
        params = SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True, seed=sample_seed(SEED + i, j))
        (alone,) = runner.generate([runner.tokenizer.encode(json.loads(row["text"]))], params)
        assert row["generated_token_ids"] == alone.token_ids
    texts = {tuple(r["generated_token_ids"]) for r in undisturbed if r["id"] == "row-000"}
    assert len(texts) > 1  # the samples differ


def test_a_killed_worker_leaves_every_pair_once(model, dataset, tmp_path, undisturbed, ray_session, monkeypatch):
    marker = tmp_path / "killed"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps({"kill_during_shard": 2, "marker": str(marker)}))
    run(build_generate_job(job_config(model, dataset, tmp_path / "out", num_workers=1, **SAMPLING)))
    assert marker.exists()
    assert read_output(tmp_path / "out") == undisturbed


def test_a_killed_driver_resumes_every_pair_once_and_another_n_is_refused(model, dataset, tmp_path, undisturbed):
    output = tmp_path / "out"
    sampling = ["--temperature", "0.8", "--seed", str(SEED), "--n", str(N)]
    command = [sys.executable, "jobs/generate.py", *job_argv(model, dataset, output, *sampling)]
    root = Path(__file__).parents[2]
    env = {**os.environ, "HYBRIDGEN_FAULT_INJECTION": json.dumps({"kill_driver_after_shards": 2})}
    driver = subprocess.Popen(command, cwd=root, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    assert driver.wait(timeout=300) == -signal.SIGKILL
    try:
        os.killpg(driver.pid, signal.SIGKILL)  # whatever of its local Ray is left
    except ProcessLookupError:
        pass
    assert len(list(output.glob("part-*.parquet"))) == 2
    with pytest.raises(OutputRefused, match=r"sampling\.n"):  # a rerun with another n is another job
        run(build_generate_job(job_config(model, dataset, output, n=2, temperature=0.8, seed=SEED)))
    rerun = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert read_output(output) == undisturbed
