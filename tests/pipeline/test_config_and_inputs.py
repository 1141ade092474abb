"""Flags, YAML config, validation before any worker starts, input formats, shard plans."""

from __future__ import annotations

import datasets
import pytest

from jobs.generate import SECTIONS, main
from pipeline.cli import build_parser, parse_sections
from pipeline.inputs import load_rows
from pipeline.remote import inside
from pipeline.sharding import default_rows_per_shard, plan_shards

BASE = ["--model", "m", "--input", "d.jsonl", "--prompt-column", "text"]


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("max_tokens: 64\nsampling:\n  top_p: 0.5\nscaling: {num_workers: 3}\nstop: ['\\n\\n']\n")
    sections = parse_sections("t", SECTIONS, [*BASE, "--config", str(config), "--max-tokens", "9", "--stop", "END"])
    assert sections["sampling"].max_tokens == 9  # flag wins
    assert sections["sampling"].top_p == 0.5  # from YAML
    assert sections["sampling"].stop == ("END",)
    assert sections["sampling"].temperature == 1.0  # dataclass default
    assert sections["scaling"].num_workers == 3


def test_unknown_yaml_key_is_named(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("max_tokenz: 5\n")
    with pytest.raises(ValueError, match=r"unknown keys \['max_tokenz'\]"):
        parse_sections("t", SECTIONS, [*BASE, "--config", str(config)])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--device", "tpu"], "--device (ModelConfig.device) = 'tpu' is invalid: must be one of auto, cuda, cpu"),
        (["--temperature", "-1"], "SamplingParams.temperature=-1.0 is invalid"),
        (["--speculative", "eagle"], "must be one of none, ngram, draft"),
        (["--speculative", "draft"], "--speculative draft needs --draft-model"),
        (
            ["--speculative-policy", "greedy"],
            "--speculative-policy (SpeculativeOptions.speculative_policy) = 'greedy' "
            "is invalid: must be one of adaptive, fixed",
        ),
        (["--max-workers", "0"], "--max-workers"),
        (["--messages-column", "m"], "exactly one of --prompt-column or --messages-column"),
    ],
)
def test_bad_flags_fail_before_any_work(extra, message, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat"}\n')
    output = tmp_path / "out"
    argv = ["--model", "m", "--input", str(data), "--prompt-column", "text", "--output", str(output), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not output.exists()


def test_missing_column_lists_the_columns(tmp_path, capsys, checkpoint_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "the cat", "key": 1}\n')
    argv = ["--model", str(checkpoint_dir("bamba")), "--input", str(data), "--prompt-column", "text",
            "--output", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    assert (
        "--prompt-column 'text' is not a column of the input; columns: ['question', 'key']" in capsys.readouterr().err
    )


def test_input_column_colliding_with_output_is_refused(tmp_path, capsys, checkpoint_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat", "error": "x"}\n')
    argv = ["--model", str(checkpoint_dir("bamba")), "--input", str(data), "--prompt-column", "text"]
    assert main(argv) == 2
    assert "collide with output columns" in capsys.readouterr().err


def test_input_formats_read_the_same_rows(tmp_path):
    rows = {"text": ["a", "b", "c"], "n": [1, 2, 3]}
    dataset = datasets.Dataset.from_dict(rows)
    dataset.to_parquet(str(tmp_path / "x.parquet"))
    dataset.to_csv(str(tmp_path / "x.csv"), index=False)
    dataset.to_json(str(tmp_path / "x.jsonl"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "dir").mkdir()
    dataset.select([0, 1]).to_parquet(str(tmp_path / "dir" / "a.parquet"))
    dataset.select([2]).to_parquet(str(tmp_path / "dir" / "b.parquet"))
    for source in ["x.parquet", "x.csv", "x.jsonl", "saved", "dir", "dir/*.parquet"]:
        assert load_rows(str(tmp_path / source)).to_dict() == rows, source
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="no Parquet/JSONL/CSV files"):
        load_rows(str(tmp_path / "none*.parquet"))


def test_shard_plan_is_contiguous_complete_and_deterministic():
    plan = plan_shards(1000, 64)
    assert plan == plan_shards(1000, 64)
    assert [s.start for s in plan] == list(range(0, 1000, 64)) and plan[-1].stop == 1000
    assert sum(s.num_rows for s in plan) == 1000
    assert plan[3].file_name == "part-00003.parquet"
    assert default_rows_per_shard(100) == 64 and default_rows_per_shard(64_000) == 2000
    assert default_rows_per_shard(10**9) == 10_000


def test_saved_dataset_dict_reads_the_split_asked_for(tmp_path):
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["a", "b"]}), "test": datasets.Dataset.from_dict({"text": ["c"]})}
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "saved")).to_dict() == {"text": ["a", "b"]}
    assert load_rows(str(tmp_path / "saved"), split="test").to_dict() == {"text": ["c"]}
    with pytest.raises(ValueError, match=r"split 'validation' not in .*available: \['test', 'train'\]"):
        load_rows(str(tmp_path / "saved"), split="validation")


def test_input_id_column_becomes_the_output_id(tmp_path, checkpoint_dir):
    from pipeline.config import GenerateJobConfig, InputConfig, ModelConfig, OutputConfig
    from pipeline.generate import build_generate_job
    from workers.actor import ShardOutput

    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "q-7", "text": "the cat"}\n{"id": "q-9", "text": "a dog"}\n')
    config = GenerateJobConfig(
        InputConfig(input=str(data), prompt_column="text"),
        ModelConfig(model=str(checkpoint_dir("bamba"))),
        output=OutputConfig(str(tmp_path / "o")),
    )
    job = build_generate_job(config)  # refused before: "input columns ['id'] collide with output columns"
    assert job.schema.names[:2] == ["id", "text"] and job.schema.field("id").type == "string"
    shard = job.plan[0]
    columns = {f.name: [None, None] for f in job.task_fields}
    table = job.output_table(shard, job.shard_rows(shard), ShardOutput(0, columns, 0.0))
    assert table.column("id").to_pylist() == ["q-7", "q-9"] and table.column_names.count("id") == 1
    assert "(default: the input's `id` column if it has one, else the row index)" in " ".join(
        build_parser("t", SECTIONS).format_help().split()
    )


def test_remote_object_keys_stay_inside_the_copy_directory(tmp_path):
    assert inside(tmp_path, "a/b.jsonl", "s3://b/in/a/b.jsonl") == tmp_path / "a" / "b.jsonl"
    assert inside(tmp_path, "a/../b.jsonl", "s3://b/in/a/../b.jsonl") == tmp_path / "b.jsonl"  # still inside
    for relative in ("../b.jsonl", "a/../../b.jsonl", "/etc/b.jsonl", "", ".", "a/.."):
        with pytest.raises(ValueError, match=f"input object 's3://b/in/{relative}' leads outside"):
            inside(tmp_path, relative, f"s3://b/in/{relative}")
