"""The generate job's `--logprobs K` / `--logprobs-mode`: the columns and their Parquet schema, the values a runner
returns for the same rows, the resume fingerprint, and bad flags (no Ray: a worker built as a plain class)."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobs.generate as generate
from pipeline.cli import parse_sections
from pipeline.config import GenerateJobConfig
from pipeline.generate import build_generate_job
from pipeline.manifest import check_output, prepare_output
from pipeline.output import OutputDir, OutputRefused
from tests.pipeline.conftest import BAD_ROWS, write_dataset
from workers import ModelRunner, SamplingParams
from workers.actor import ShardTask, ShardWorker
from workers.rows import LOGPROBS_FIELDS

NUM_ROWS = 20


def job_from_flags(model, data, output, *flags: str):
    """The job `jobs/generate.py` builds from these flags (8 rows per shard, 1 worker, sampled, seed 5)."""
    argv = ["--model", str(model), "--input", str(data), "--prompt-column", "text", "--id-column", "key"]
    argv += ["--output", str(output), "--max-model-len", "40", "--max-tokens", "5", "--temperature", "0.8"]
    argv += ["--top-k", "20", "--seed", "5", "--ignore-eos", "--rows-per-shard", "8", "--num-workers", "1", *flags]
    return build_generate_job(GenerateJobConfig(**parse_sections("generate", generate.SECTIONS, argv)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "prompts.jsonl", NUM_ROWS)


def test_logprobs_columns_schema_and_values(checkpoint_dir, data, tmp_path):
    model = checkpoint_dir("granite_dense")
    job = job_from_flags(model, data, tmp_path / "out", "--logprobs", "3", "--logprobs-mode", "processed")
    assert job.worker.engine.sampler.logprobs_mode == "processed_logprobs"
    assert job.schema.field("logprobs").type == pa.list_(pa.float32())
    assert job.schema.field("top_logprobs").type == pa.list_(
        pa.list_(pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())]))
    )
    shard = job.plan[1]  # rows 8 … 15: the bad row 11 among them
    rows = job.shard_rows(shard)
    output = ShardWorker(job.worker).process(ShardTask(shard.index, shard.start, rows))
    out = OutputDir(str(tmp_path / "out"))
    out.create()
    out.write_table(shard.file_name, job.output_table(shard, rows, output), {})
    table = pq.read_table(out.join(shard.file_name))
    assert table.schema.field("top_logprobs").type == job.schema.field("top_logprobs").type
    written = table.to_pylist()
    # The same rows through a runner of the same engine config, row i seeded with seed + i.
    runner = ModelRunner.from_pretrained(str(model), job.worker.engine)
    good = [(i, row) for i, row in enumerate(written) if not row["error"]]
    assert {shard.start + i for i, row in enumerate(written) if row["error"]} == set(BAD_ROWS) & set(range(8, 16))
    params = [
        SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=5 + shard.start + i, ignore_eos=True, logprobs=3)
        for i, _ in good
    ]
    # The mixed-type `text` column (strings and an int) is stored by `datasets` as JSON text.
    direct = runner.generate([runner.tokenizer.encode(json.loads(row["text"])) for _, row in good], params)
    for (_, row), result in zip(good, direct):
        assert row["generated_token_ids"] == result.token_ids
        expected = [entry[token] for token, entry in zip(result.token_ids, result.logprobs)]
        assert row["logprobs"] == pytest.approx(expected, rel=1e-6)
        for top, entry in zip(row["top_logprobs"], result.logprobs):
            assert [t["token_id"] for t in top] == list(entry)[:3]
            values = [t["logprob"] for t in top]
            assert values == pytest.approx(list(entry.values())[:3], rel=1e-6)
            assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
    assert all(row["logprobs"] is None and row["top_logprobs"] is None for row in written if row["error"])


def test_without_logprobs_no_columns_and_a_rerun_with_them_is_another_job(checkpoint_dir, data, tmp_path):
    model = checkpoint_dir("granite_dense")
    plain = job_from_flags(model, data, tmp_path)
    assert not {f.name for f in LOGPROBS_FIELDS} & set(plain.schema.names)
    assert "logprobs" not in ShardWorker(plain.worker).process(ShardTask(0, 0, plain.shard_rows(plain.plan[0]))).columns
    prepare_output(OutputDir(str(tmp_path)), plain, overwrite=False)
    with pytest.raises(OutputRefused, match=r"different job \(sampling.logprobs: None → 2"):
        check_output(OutputDir(str(tmp_path)), job_from_flags(model, data, tmp_path, "--logprobs", "2"), False)
    with_logprobs = job_from_flags(model, data, tmp_path / "b", "--logprobs", "2")
    prepare_output(OutputDir(str(tmp_path / "b")), with_logprobs, overwrite=False)
    other_mode = job_from_flags(model, data, tmp_path / "b", "--logprobs", "2", "--logprobs-mode", "processed")
    with pytest.raises(OutputRefused, match="sampling.logprobs_mode: 'raw_logprobs' → 'processed_logprobs'"):
        check_output(OutputDir(str(tmp_path / "b")), other_mode, False)
    # The full name and the short one are one job.
    same = job_from_flags(model, data, tmp_path / "b", "--logprobs", "2", "--logprobs-mode", "raw")
    assert check_output(OutputDir(str(tmp_path / "b")), same, False).differences == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--logprobs", "21"], r"SamplingParams.logprobs=21 is invalid: must be None \(no logprobs\) or an integer in"),
        (["--logprobs", "-1"], r"SamplingParams.logprobs=-1 is invalid"),
        (["--logprobs-mode", "raw_logits"], r"--logprobs-mode .* 'raw_logits' is invalid: must be raw, processed"),
    ],
)
def test_bad_logprobs_flags_are_refused_before_work_starts(flags, message, data, tmp_path):
    with pytest.raises(ValueError, match=message):
        job_from_flags(tmp_path / "no-model", data, tmp_path / "out", *flags)
