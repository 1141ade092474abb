"""Hung, slow and failing workers through the CLI on a local Ray with one worker streaming three shards: a frozen
engine is stopped once and each shard it held requeued once (with a fixed deadline and by its progress stopping), a
slow worker that keeps making progress is never stopped however long its shards take, a failed step fails only the
shards it ran, and a job that fails says why in one line.

Timing: the automatic rules are scaled from minutes to seconds here; a worker's steps take ~0.05 s (0.3 s when the
machine is busy), and every window below is ten times that or more.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

import pipeline.liveness
from jobs.generate import main
from pipeline.output import MANIFEST
from tests.pipeline.conftest import NUM_ROWS, job_argv, read_output

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


@pytest.fixture(scope="module")
def undisturbed(model, dataset, tmp_path_factory, ray_session) -> list[dict]:
    output = tmp_path_factory.mktemp("undisturbed")
    assert main(job_argv(model, dataset, output)) == 0
    return read_output(output)


@pytest.fixture
def seconds_scale(monkeypatch):
    """The automatic hang rules in seconds instead of minutes."""
    scaled = {"FIRST_FORWARD_TIMEOUT_S": 60.0, "MIN_STALL_TIMEOUT_S": 5.0, "STALL_FACTOR": 3.0}
    for name, value in {**scaled, "PROGRESS_INTERVAL_S": 0.5}.items():
        monkeypatch.setattr(pipeline.liveness, name, value)


def _requeued(err: str) -> Counter[int]:
    return Counter(int(m) for m in re.findall(r"shard (\d+) requeued", err))  # lines may follow a bar's \r


def _inject(monkeypatch, tmp_path: Path, **plan) -> Path:
    marker = tmp_path / "fault"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps({**plan, "marker": str(marker)}))
    return marker


def test_a_frozen_engine_past_a_fixed_deadline_is_stopped_once(
    model, dataset, tmp_path, undisturbed, monkeypatch, capfd
):
    # The engine freezes in its third step: all three shards it streams freeze, and shards handed out together share
    # a deadline. Before, the driver stopped the worker for the first and crashed (KeyError) on the second.
    marker = _inject(monkeypatch, tmp_path, freeze_step=3)
    assert main(job_argv(model, dataset, tmp_path / "out", "--shard-timeout-s", "20")) == 0
    assert marker.exists() and read_output(tmp_path / "out") == undisturbed
    err = capfd.readouterr().err
    requeued = _requeued(err)
    assert set(requeued) == {0, 1, 2} and set(requeued.values()) == {1}, err  # each shard it held, once
    assert "TimeoutError: no result within 20 s (--shard-timeout-s); its worker was stopped" in err
    assert "Traceback" not in err


def test_a_frozen_engine_is_stopped_when_its_progress_stops(
    model, dataset, tmp_path, undisturbed, monkeypatch, capfd, seconds_scale
):
    marker = _inject(monkeypatch, tmp_path, freeze_step=3)
    assert main(job_argv(model, dataset, tmp_path / "out")) == 0  # no --shard-timeout-s: automatic
    assert marker.exists() and read_output(tmp_path / "out") == undisturbed
    err = capfd.readouterr().err
    requeued = _requeued(err)
    assert set(requeued) == {0, 1, 2} and set(requeued.values()) == {1}, err
    charged = re.findall(
        r"shard (\d+) requeued \(1 of at most 3 retries\): TimeoutError: its worker made no "
        r"progress for \d+ s \(auto: 3 × its longest forward",
        err,
    )
    assert len(charged) == 1, err  # the shard it held longest takes the retry; the other two do not
    assert err.count("requeued (no retry used): its worker was stopped") == 2


def test_a_slow_worker_that_makes_progress_is_never_stopped(
    model, dataset, tmp_path, monkeypatch, capfd, seconds_scale
):
    # Each step sleeps 0.15 s (a slow CPU worker): every shard takes longer than the stall window, and longer than
    # any deadline a constant could have set for a first shard. Before, the first-shard deadline killed the healthy
    # worker, its retries got the same deadline, and the job failed with nothing written.
    _inject(monkeypatch, tmp_path, slow_step_s=0.15)
    assert main(job_argv(model, dataset, tmp_path / "out", "--rows-per-shard", "16", "--max-tokens", "20")) == 0
    err = capfd.readouterr().err
    assert "requeued" not in err and "stopped" not in err, err
    shards = json.loads((tmp_path / "out" / MANIFEST).read_text())["shards"]
    assert sum(info["rows"] for info in shards.values()) == NUM_ROWS
    assert min(info["seconds"] for info in shards.values()) > pipeline.liveness.MIN_STALL_TIMEOUT_S


def test_a_failed_step_fails_only_the_shards_it_ran_and_keeps_the_worker(
    model, dataset, tmp_path, undisturbed, monkeypatch, capfd
):
    # The third step raises once (a transient out-of-memory). It ran the rows of one or two of the three shards in
    # flight (8 slots, 7 runnable rows a shard); only those fail, each once, and the failure counts once against the
    # worker. Before, all three failed, each counted, and the worker was replaced.
    marker = _inject(monkeypatch, tmp_path, fail_step=3)
    assert main(job_argv(model, dataset, tmp_path / "out")) == 0
    assert marker.exists() and read_output(tmp_path / "out") == undisturbed
    err = capfd.readouterr().err
    assert "replacing it" not in err, err
    requeued = _requeued(err)
    assert 1 <= len(requeued) <= 2 and set(requeued.values()) == {1}, err
    assert "StepFailed: RuntimeError: CUDA out of memory (injected, step 3)" in err


def test_a_failed_job_says_why_in_one_line(model, dataset, tmp_path, monkeypatch, capfd):
    _inject(monkeypatch, tmp_path, break_during_shard=2)
    assert main(job_argv(model, dataset, tmp_path / "out", "--max-shard-retries", "0")) == 1
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err  # the broken worker fails shard 2, or another it holds, first
    assert re.fullmatch(
        r"error: shard (\d) \(rows \d+–\d+\) failed 1 times; last error: RuntimeError: CUDA error: an "
        r"illegal memory access was encountered \(injected, shard \1\)",
        lines[0],
    ), lines[0]
    assert err.rstrip().endswith(lines[0]) and "Traceback" not in err and "\x1b[" not in err
