"""jobs/score.py end to end through a local Ray: every row once, scores equal the runner's, resume, manifest."""

from __future__ import annotations

import json
import math

import pytest

from jobs.score import main
from tests.pipeline.conftest import BAD_ROWS, NUM_ROWS, read_output
from workers import ModelRunner
from workers.scoring import ScoreSpec, score_shard

pytestmark = pytest.mark.slow


def _argv(model, dataset, output, *extra):
    return [
        "--model",
        str(model),
        "--input",
        str(dataset),
        "--text-column",
        "text",
        "--id-column",
        "key",
        "--max-model-len",
        "12",
        "--num-workers",
        "2",
        "--rows-per-shard",
        "10",
        "--ray-address",
        "local",
        "--output",
        str(output),
        *extra,
    ]


def test_score_job_end_to_end_with_resume(checkpoint_dir, dataset, tmp_path, ray_session, capsys):
    model = checkpoint_dir("nemotron_moe")
    output = tmp_path / "scores"
    assert main(_argv(model, dataset, output, "--token-logprobs")) == 0
    rows = read_output(output)
    assert [row["id"] for row in rows] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
    runner = ModelRunner.from_pretrained(str(model), max_model_len=12)
    texts = [json.loads(row["text"]) for row in rows]  # mixed-type column: stored as JSON text
    direct = score_shard(runner, [{"text": t} for t in texts], ScoreSpec(text_column="text"))
    for i, row in enumerate(rows):
        if i in BAD_ROWS or direct["error"][i]:
            assert row["error"] == direct["error"][i] and row["error"]
            continue
        assert row["sum_logprob"] == pytest.approx(direct["sum_logprob"][i], abs=1e-4)
        assert len(row["token_logprobs"]) == row["num_scored_tokens"]
    manifest = json.loads((output / "_manifest.json").read_text())
    good = [r for r in rows if not r["error"]]
    expected = math.exp(-sum(r["sum_logprob"] for r in good) / sum(r["num_scored_tokens"] for r in good))
    assert manifest["totals"]["corpus_perplexity"] == pytest.approx(expected, rel=1e-9)
    # Resume: lose two shard files; the rerun recomputes them only, and the output is the same.
    stamps = {p.name: p.stat().st_mtime_ns for p in output.glob("part-*.parquet")}
    for name in ("part-00001.parquet", "part-00003.parquet"):
        (output / name).unlink()
    (output / "_SUCCESS").unlink()
    assert main(_argv(model, dataset, output, "--token-logprobs")) == 0
    after = {p.name: p.stat().st_mtime_ns for p in output.glob("part-*.parquet")}
    assert {n for n in after if after[n] != stamps[n]} == {"part-00001.parquet", "part-00003.parquet"}
    assert read_output(output) == rows


def test_score_flags_are_checked_before_work(tmp_path, capsys, dataset):
    assert main(["--model", "m", "--input", str(dataset), "--prompt-column", "text"]) == 2
    assert (
        "exactly one of --text-column, --messages-column, or --prompt-column with --completion-column"
        in capsys.readouterr().err
    )
