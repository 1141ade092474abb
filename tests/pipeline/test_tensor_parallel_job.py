"""A job whose workers each split the model over two ranks, on a local Ray with 4 CPUs: every row once, output equal
to the unsplit job's; a rank killed mid-shard takes its worker down, the worker is replaced, its shards requeued,
and the output is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.driver import run
from pipeline.generate import build_generate_job
from tests.pipeline.conftest import BAD_ROWS, NUM_ROWS, job_config, read_output

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_4_cpus():
    """A local Ray with 4 logical CPUs: two workers of two ranks, one CPU per rank (the driver joins it)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


@pytest.fixture(scope="module")
def unsplit(model, dataset, tmp_path_factory, ray_4_cpus) -> list[dict]:
    output = tmp_path_factory.mktemp("unsplit")
    run(build_generate_job(job_config(model, dataset, output)))
    return read_output(output)


def _split_job(model: Path, dataset: Path, output: Path):
    return build_generate_job(job_config(model, dataset, output, tensor_parallel_size=2, cpus_per_worker=1))


def test_split_workers_write_every_row_once_as_unsplit_ones(model, dataset, tmp_path, unsplit):
    totals = run(_split_job(model, dataset, tmp_path))
    rows = read_output(tmp_path)
    assert [row["id"] for row in rows] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    assert totals["rows"] == NUM_ROWS
    assert {int(row["id"][4:]) for row in rows if row["error"]} == set(BAD_ROWS)
    assert [row["generated_token_ids"] for row in rows] == [row["generated_token_ids"] for row in unsplit]


def test_a_rank_killed_mid_shard_replaces_its_worker_and_the_output_is_unchanged(
    model, dataset, tmp_path, unsplit, monkeypatch, capfd
):
    marker = tmp_path / "killed"
    fault = {"kill_rank_during_shard": 2, "rank": 1, "marker": str(marker)}
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps(fault))
    run(_split_job(model, dataset, tmp_path / "out"))
    assert marker.exists(), "a rank really died in the middle of shard 2"
    rows = read_output(tmp_path / "out")
    assert [row["id"] for row in rows] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    assert [row["generated_token_ids"] for row in rows] == [row["generated_token_ids"] for row in unsplit]
    requeued = [line for line in capfd.readouterr().err.split("\r") if " requeued " in line]
    assert requeued and all("ActorDiedError" in line for line in requeued), "the worker died: no retry of a raise"
    assert "rank 1 of process" in marker.read_text()
