"""The generate job's logits-option flags (`--presence-penalty` … `--allowed-token-ids`): every row's
SamplingParams carries them (the worker's output equals a runner's with the same params), they are part of the resume
fingerprint, bad values are refused before work starts, token ids beyond the vocabulary fail the rows, not the job
(no Ray: a worker built as a plain class)."""

from __future__ import annotations

import json

import pytest

from pipeline.manifest import check_output, prepare_output
from pipeline.output import OutputDir, OutputRefused
from tests.pipeline.conftest import BAD_ROWS, write_dataset
from tests.pipeline.test_logprobs_job import job_from_flags
from workers import ModelRunner, SamplingParams
from workers.actor import ShardTask, ShardWorker

OPTIONS = ["--presence-penalty", "0.5", "--frequency-penalty", "0.8", "--repetition-penalty", "1.3", "--min-p", "0.05"]
OPTIONS += ["--min-tokens", "2", "--logit-bias", '{"9": 2.5}', "--bad-words", "cat", "--bad-words", "big dog"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "prompts.jsonl", 20)  # a mixed-type text column: JSON


def test_every_row_samples_with_the_options(checkpoint_dir, data, tmp_path):
    model = checkpoint_dir("granite_dense")
    job = job_from_flags(model, data, tmp_path / "out", *OPTIONS)
    shard = job.plan[0]
    rows = job.shard_rows(shard)
    output = ShardWorker(job.worker).process(ShardTask(shard.index, shard.start, rows))
    written = job.output_table(shard, rows, output).to_pylist()
    runner = ModelRunner.from_pretrained(str(model), job.worker.engine)
    good = [(i, row) for i, row in enumerate(written) if not row["error"]]
    assert len(good) >= 4
    options = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3, min_p=0.05, min_tokens=2)
    options |= dict(logit_bias={9: 2.5}, bad_words=("cat", "big dog"))
    base = dict(max_tokens=5, temperature=0.8, top_k=20, ignore_eos=True)
    prompts = [runner.tokenizer.encode(json.loads(row["text"])) for _, row in good]
    with_options = [SamplingParams(**base, **options, seed=5 + shard.start + i) for i, _ in good]
    without = [SamplingParams(**base, seed=5 + shard.start + i) for i, _ in good]
    direct = runner.generate(prompts, with_options)
    assert [row["generated_token_ids"] for _, row in good] == [r.token_ids for r in direct]
    assert [r.token_ids for r in direct] != [r.token_ids for r in runner.generate(prompts, without)]


def test_the_options_are_in_the_resume_fingerprint(checkpoint_dir, data, tmp_path):
    model = checkpoint_dir("granite_dense")
    out = OutputDir(str(tmp_path))
    prepare_output(out, job_from_flags(model, data, tmp_path, *OPTIONS), overwrite=False)
    for flag, value, change in [
        ("--repetition-penalty", "1.1", "sampling.repetition_penalty: 1.3 → 1.1"),
        ("--logit-bias", '{"9": 1}', "sampling.logit_bias"),
        ("--bad-words", "red", "sampling.bad_words"),
    ]:
        with pytest.raises(OutputRefused, match=change):  # the later flag wins; a repeated one adds a word
            check_output(out, job_from_flags(model, data, tmp_path, *OPTIONS, flag, value), False)
    same = job_from_flags(model, data, tmp_path, *OPTIONS[:-6], "--logit-bias", '{"9": 2.50}', *OPTIONS[-4:])
    assert check_output(out, same, False).differences == []  # one spelling of the bias in the fingerprint


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--presence-penalty", "3"], r"SamplingParams.presence_penalty=3.0 is invalid: must be a number in \[-2, 2\]"),
        (["--repetition-penalty", "0"], r"SamplingParams.repetition_penalty=0.0 is invalid"),
        (["--min-p", "1.5"], r"SamplingParams.min_p=1.5 is invalid"),
        (["--logit-bias", '{"x": 1}'], r"--logit-bias \(SamplingConfig.logit_bias\)"),
        (["--allowed-token-ids", "x"], r"--allowed-token-ids \(SamplingConfig.allowed_token_ids\)"),
    ],
)
def test_bad_option_flags_are_refused_before_work_starts(flags, message, data, tmp_path):
    with pytest.raises(ValueError, match=message):
        job_from_flags(tmp_path / "no-model", data, tmp_path / "out", *flags)


def test_token_ids_beyond_the_vocabulary_fail_the_rows_not_the_job(checkpoint_dir, data, tmp_path):
    model = checkpoint_dir("granite_dense")
    job = job_from_flags(model, data, tmp_path / "out", "--allowed-token-ids", "[5, 6, 500]")
    shard = job.plan[0]
    rows = job.shard_rows(shard)
    written = job.output_table(shard, rows, ShardWorker(job.worker).process(ShardTask(0, 0, rows))).to_pylist()
    assert len(written) == len(rows)
    named = {shard.start + i for i, row in enumerate(written) if "allowed_token_ids" in (row["error"] or "")}
    assert named == set(range(shard.start, shard.start + len(rows))) - set(BAD_ROWS)  # bad rows fail as before
