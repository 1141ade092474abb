"""Shared pieces of the pipeline tests: a small JSONL dataset with bad rows, a local Ray session, a job builder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from pipeline.config import (
    ChatConfig,
    GenerateJobConfig,
    InputConfig,
    ModelConfig,
    OutputConfig,
    SamplingConfig,
    ScalingConfig,
    SpeculativeOptions,
)
from tests.tiny_models import WORDS

NUM_ROWS = 48
BAD_ROWS = {5: "", 11: 123, 17: " ".join(["cat"] * 60)}  # empty, not a string, longer than max_model_len


def write_dataset(path: Path, num_rows: int = NUM_ROWS) -> Path:
    """JSONL rows {key, text} of random words, with the bad rows above."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(num_rows):
            text = BAD_ROWS.get(i, " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))))
            f.write(json.dumps({"key": f"row-{i:03d}", "text": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "prompts.jsonl")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module's in-process jobs, shut down at the end."""
    import ray

    yield
    ray.shutdown()


def job_config(model: Path, data: Path, output: Path, **overrides) -> GenerateJobConfig:
    """A greedy 2-worker job over `data`; `overrides` replace section fields by name."""
    sections = {
        "input": dict(input=str(data), prompt_column="text", id_column="key"),
        "model": dict(model=str(model), max_model_len=40, max_num_seqs=8),
        "sampling": dict(max_tokens=6, temperature=0.0, ignore_eos=True),
        "scaling": dict(num_workers=2, rows_per_shard=8, ray_address="local"),
        "chat": dict(),
        "speculative": dict(),
        "output": dict(output=str(output)),
    }
    classes = {"input": InputConfig, "model": ModelConfig, "sampling": SamplingConfig, "chat": ChatConfig,
               "speculative": SpeculativeOptions, "scaling": ScalingConfig, "output": OutputConfig}  # fmt: skip
    for key, value in overrides.items():
        section = next(name for name, cls in classes.items() if key in cls.__dataclass_fields__)
        sections[section][key] = value
    return GenerateJobConfig(**{name: classes[name](**values) for name, values in sections.items()})


def job_argv(model: Path, data: Path, output: Path, *flags: str) -> list[str]:
    """`jobs/generate.py`'s command line for `job_config`'s job run by one worker; `flags` are appended (a repeated
    flag's last value wins)."""
    paths = ["--model", str(model), "--input", str(data), "--output", str(output)]
    columns = ["--prompt-column", "text", "--id-column", "key", "--max-model-len", "40", "--max-num-seqs", "8"]
    sampling = ["--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    scaling = ["--num-workers", "1", "--rows-per-shard", "8", "--ray-address", "local"]
    return [*paths, *columns, *sampling, *scaling, *flags]


def read_output(directory: Path) -> list[dict]:
    """All output rows, sorted by id (and sample_index: a row has one output row per sample)."""
    table = pads.dataset(str(directory), format="parquet").to_table()
    return sorted(table.to_pylist(), key=lambda row: (row["id"], row.get("sample_index", 0)))
