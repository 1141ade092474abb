"""End to end through a local Ray with 2 CPU workers: exactly-once output, bad rows, resume, worker crashes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.output import MANIFEST, SUCCESS
from tests.pipeline.conftest import BAD_ROWS, NUM_ROWS, job_config, read_output
from workers import ModelRunner, SamplingParams
from workers.stream import SHARDS_PER_WORKER

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


@pytest.fixture(scope="module")
def undisturbed(model, dataset, tmp_path_factory, ray_session) -> list[dict]:
    """The reference run; its output is what every disturbed run must reproduce."""
    output = tmp_path_factory.mktemp("undisturbed")
    totals = run(build_generate_job(job_config(model, dataset, output)))
    assert totals["rows"] == NUM_ROWS
    return read_output(output)


def test_every_row_once_with_errors_and_runner_equal_text(model, dataset, undisturbed):
    assert [row["id"] for row in undisturbed] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    errors = {int(row["id"][4:]): row["error"] for row in undisturbed if row["error"]}
    assert set(errors) == set(BAD_ROWS)
    assert errors[5] == "prompt text is empty"
    assert "must be a string" in errors[11]
    assert "more than max_model_len=40" in errors[17]
    runner = ModelRunner.from_pretrained(str(model), max_model_len=40)
    good = [row for row in undisturbed if not row["error"]]
    # The mixed-type `text` column (strings and an int) is stored by `datasets` as JSON text.
    direct = runner.generate(
        [runner.tokenizer.encode(json.loads(row["text"])) for row in good],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert [row["generated_token_ids"] for row in good] == [r.token_ids for r in direct]
    assert [row["generated_text"] for row in good] == [r.text for r in direct]
    assert all(row["finish_reason"] == "length" and row["num_generated_tokens"] == 6 for row in good)


def test_manifest_and_success_marker(model, dataset, tmp_path, ray_session):
    totals = run(build_generate_job(job_config(model, dataset, tmp_path)))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert (tmp_path / SUCCESS).exists() and manifest["status"] == "complete"
    assert [(p["start"], p["stop"]) for p in manifest["plan"]] == [(i, i + 8) for i in range(0, NUM_ROWS, 8)]
    assert totals["generated_tokens"] == 6 * (NUM_ROWS - len(BAD_ROWS)) == manifest["totals"]["generated_tokens"]
    assert manifest["model"]["model_type"] == "granitemoehybrid"


def test_rerun_keeps_finished_files_and_other_config_needs_overwrite(model, dataset, tmp_path, ray_session):
    first = run(build_generate_job(job_config(model, dataset, tmp_path)))
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("part-*.parquet")}
    second = run(build_generate_job(job_config(model, dataset, tmp_path)))
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("part-*.parquet")} == stamps
    # Throughput per run and in total: the rerun computed nothing, and the total is not divided by its wall alone.
    runs = json.loads((tmp_path / MANIFEST).read_text())["runs"]
    assert [r["shards_written"] for r in runs] == [NUM_ROWS // 8, 0]
    assert runs[0]["generated_tokens"] == second["generated_tokens"] and runs[1]["generated_tokens_per_second"] == 0
    assert runs[0]["generated_tokens_per_second"] == first["generated_tokens_per_second"]
    assert second["generated_tokens_per_second"] == pytest.approx(
        second["generated_tokens"] / (runs[0]["wall_seconds"] + runs[1]["wall_seconds"])
    )
    assert second["runs"] == 2 and second["untimed_shards"] == 0
    with pytest.raises(ValueError, match=r"different job \(sampling.max_tokens: 6 → 7.*--overwrite"):
        run(build_generate_job(job_config(model, dataset, tmp_path, max_tokens=7)))
    run(build_generate_job(job_config(model, dataset, tmp_path, max_tokens=7, overwrite=True)))
    assert {row["num_generated_tokens"] for row in read_output(tmp_path) if not row["error"]} == {7}


def test_killed_worker_shard_is_retried_and_output_identical(
    model, dataset, tmp_path, undisturbed, ray_session, monkeypatch
):
    marker = tmp_path / "killed"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps({"kill_during_shard": 2, "marker": str(marker)}))
    run(build_generate_job(job_config(model, dataset, tmp_path / "out")))
    assert marker.exists()  # a worker process really died in the middle of shard 2
    assert read_output(tmp_path / "out") == undisturbed


def test_a_worker_crash_mid_stream_requeues_exactly_its_unfinished_shards(
    model, dataset, tmp_path, undisturbed, ray_session, monkeypatch, capfd
):
    """One worker streaming its shards (three at a time) dies in shard 3: the shards it held and had not returned
    are requeued, those it returned before stay written, and the output is the undisturbed run's."""
    marker = tmp_path / "killed"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps({"kill_during_shard": 3, "marker": str(marker)}))
    run(build_generate_job(job_config(model, dataset, tmp_path / "out", num_workers=1)))
    assert marker.exists()
    assert read_output(tmp_path / "out") == undisturbed
    requeued = {int(line.split()[1]) for line in capfd.readouterr().err.splitlines() if " requeued " in line}
    # What it held when it died: shard 3 and the others still in flight, never more than a worker holds. Which
    # others depends on timing (shard 3 starts when any of 0, 1, 2 returns: a shard returns with its slowest row).
    # A driver that requeued every shard it had sent the worker would requeue 0–3 and fail the bound.
    assert 3 in requeued and len(requeued) <= SHARDS_PER_WORKER


def test_broken_worker_gets_no_retry_of_its_shard_and_is_replaced(
    model, dataset, tmp_path, undisturbed, ray_session, monkeypatch, capfd
):
    # The first worker to get shard 2 raises on it and on every later shard (a broken CUDA context). Before, the
    # failed shard went back to that worker until its retries ran out and the job failed. Now the retry goes to the
    # other worker when it is ready (else to the same one once more), and the broken worker is replaced after its
    # second failure. (Which worker a retry may take: tests/pipeline/test_retry.py.) Shards of 2 rows, 24 of them:
    # with 6 shards both workers' first three were all there was, and when the first worker to be ready took shards
    # 0-2 the broken one had nothing left to fail on (1 run in 3); with 12, 1 in ~25 still let the other worker
    # take every later shard.
    marker = tmp_path / "broken"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps({"break_during_shard": 2, "marker": str(marker)}))
    run(build_generate_job(job_config(model, dataset, tmp_path / "out", rows_per_shard=2)))
    assert marker.exists()
    assert read_output(tmp_path / "out") == undisturbed
    err = capfd.readouterr().err
    # Shard 2 breaks the worker; its calls for shards 0–2 run on threads that may start in any order, so the first
    # to fail and be requeued may be another shard it holds (shard 2 is then requeued without a retry when the
    # worker is replaced).
    assert re.search(r"shard \d+ requeued \(1 of at most 3 retries\): RuntimeError: CUDA error", err), err
    assert err.count("a worker failed 2 times: replacing it") == 1
    assert "(3 of at most 3 retries)" not in err


def test_hung_worker_is_killed_at_the_shard_deadline(
    model, dataset, tmp_path, undisturbed, ray_session, monkeypatch, capfd
):
    # A worker hangs in shard 2 (alive, never answers). The driver kills it after --shard-timeout-s, requeues the
    # shard (a retry) and starts another worker; the job ends with every row once. Before, it waited forever. (A
    # worker's first shard takes ~4 s here: the timeout leaves room for it, 7× over, for a loaded or slower machine.
    # The automatic deadline: tests/pipeline/test_retry.py.)
    marker = tmp_path / "hung"
    monkeypatch.setenv("HYBRIDGEN_FAULT_INJECTION", json.dumps({"hang_during_shard": 2, "marker": str(marker)}))
    config = job_config(model, dataset, tmp_path / "out", shard_timeout_s=30.0, max_shard_retries=1)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(totals=run(build_generate_job(config))), daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(timeout=240)
    assert not thread.is_alive(), "the job hung with its worker"
    assert marker.exists() and outcome["totals"]["rows"] == NUM_ROWS
    assert read_output(tmp_path / "out") == undisturbed
    err = capfd.readouterr().err
    assert "shard 2 requeued (1 of at most 1 retries): TimeoutError: no result within 30 s (--shard-timeout-s)" in err
    assert time.monotonic() - start < 180


def test_a_templated_job_reuses_its_prefix_and_writes_what_no_cache_writes(model, tmp_path, ray_session):
    """24 rows sharing a 120-word template: with the prefix cache (default) the rows restore the template's states
    (the manifest and totals count the restored prompt tokens), and the output equals --no-enable-prefix-caching."""
    import random

    from tests.tiny_models import WORDS

    rng = random.Random(7)
    template = " ".join(rng.choice(WORDS) for _ in range(120))
    data = tmp_path / "templated.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "key": f"row-{i:02d}",
                    "text": f"{template} {rng.choice(WORDS)} {rng.choice(WORDS)} {rng.choice(WORDS)}",
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    totals = {}
    for caching in (True, False):
        config = job_config(
            model, data, tmp_path / f"out-{caching}", max_model_len=200, num_workers=1, enable_prefix_caching=caching
        )
        totals[caching] = run(build_generate_job(config))
    assert read_output(tmp_path / "out-True") == read_output(tmp_path / "out-False")
    assert totals[True]["prefix_cache_hit_tokens"] >= 20 * 64 and totals[False]["prefix_cache_hit_tokens"] == 0
    assert 0 < totals[True]["prefix_cache_hit_rate"] < 1


def test_chat_messages_column(model, tmp_path, ray_session):
    rows = [{"messages": [{"role": "user", "content": "the cat sat"}]},
            {"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "a dog"},
                          {"role": "user", "content": "big red mat"}]},
            {"messages": []}]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = job_config(
        model, data, tmp_path / "out", prompt_column=None, messages_column="messages", id_column=None, max_model_len=64
    )
    run(build_generate_job(config))
    out = read_output(tmp_path / "out")
    assert [row["id"] for row in out] == [0, 1, 2]
    runner = ModelRunner.from_pretrained(str(model))
    ids = runner.tokenizer.apply_chat_template(
        rows[1]["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out[1]["num_prompt_tokens"] == len(ids) and out[1]["error"] is None
    assert "non-empty list" in out[2]["error"]


def test_killed_driver_resumes_to_the_same_output(model, dataset, tmp_path, undisturbed):
    output = tmp_path / "out"
    command = [sys.executable, "jobs/generate.py", "--model", str(model), "--input", str(dataset), "--prompt-column",
               "text", "--id-column", "key", "--max-model-len", "40", "--max-num-seqs", "8", "--max-tokens", "6",
               "--temperature", "0", "--ignore-eos", "--num-workers", "1", "--rows-per-shard", "8",
               "--ray-address", "local", "--output", str(output)]  # fmt: skip
    root = Path(__file__).parents[2]
    # The driver kills itself (SIGKILL) right after writing its second shard file.
    env = {**os.environ, "HYBRIDGEN_FAULT_INJECTION": json.dumps({"kill_driver_after_shards": 2})}
    driver = subprocess.Popen(command, cwd=root, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    assert driver.wait(timeout=300) == -signal.SIGKILL
    try:
        os.killpg(driver.pid, signal.SIGKILL)  # whatever of its local Ray is left
    except ProcessLookupError:
        pass
    finished = {p.name: p.stat().st_mtime_ns for p in output.glob("part-*.parquet")}
    assert len(finished) == 2 and not (output / SUCCESS).exists()
    rerun = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    after = {p.name: p.stat().st_mtime_ns for p in output.glob("part-*.parquet")}
    assert {name: after[name] for name in finished} == finished  # finished shard files untouched
    assert len(after) == NUM_ROWS // 8
    assert read_output(output) == undisturbed
    totals = json.loads((output / MANIFEST).read_text())["totals"]
    assert (totals["runs"], totals["untimed_shards"]) == (2, 2)  # the killed run's shards have no wall time
