"""`jobs/run_batch.py`: an OpenAI batch file through the generation job's sharded, resumable pipeline.

1. The input JSONL (local or s3://…) is read and parsed (`pipeline/openai_batch.py`); its runnable lines become
   `WORK/requests.parquet` (one row per line: its prompt or messages, and its body's sampling fields as the row's
   `sampling_params`). The same input writes the same file, so the job's resume fingerprint is unchanged.
2. That file runs as a generate job with `--sampling-params-column sampling_params`, its Parquet shards written to
   `WORK/shards` (kept across runs: a rerun after a crash resumes). A line asking for n choices: the job runs the
   largest n of the file for every line and keeps each line's first n (sample j does not depend on n).
3. The output JSONL is assembled from the shards, one line per input line in input order
   (`pipeline/openai_output.py`), written under a temporary name and renamed.

WORK is `--output-dir`, or `OUTPUT_FILE.parts` beside the output file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.config import GenerateJobConfig, InputConfig, OutputConfig
from pipeline.fields import doc, fail
from pipeline.job import Job
from pipeline.openai_batch import BatchRequest, LineError, parse_lines
from pipeline.openai_output import error_line, response_line
from pipeline.output import MANIFEST, OutputDir

REQUESTS_FILE = "requests.parquet"
REQUEST_SCHEMA = pa.schema(
    [
        pa.field("line", pa.int64()),
        pa.field("custom_id", pa.string()),
        pa.field("url", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("messages", pa.string()),
        pa.field("sampling_params", pa.string()),
        pa.field("n", pa.int32()),
    ]
)


@dataclass(frozen=True)
class BatchFileConfig:
    """vLLM's `run_batch` files, and where the job keeps its work."""

    input_file: str = doc(
        "-i: the OpenAI batch input, a JSONL file of request lines (local path or s3://…)", default=""
    )
    output_file: str = doc("-o: the OpenAI batch output JSONL to write (local path or s3://…)", default="")
    output_dir: str | None = doc(
        "work directory for the job's requests.parquet and Parquet shards, kept so that a rerun resumes "
        "(default: OUTPUT_FILE.parts beside the output file)",
        default=None,
    )
    overwrite: bool = doc("replace a work directory written for another input or other flags", default=False)

    def __post_init__(self) -> None:
        if not self.input_file:
            fail("BatchFileConfig", "input_file", self.input_file, "give the batch input JSONL (-i)")
        if not self.output_file:
            fail("BatchFileConfig", "output_file", self.output_file, "give the batch output JSONL (-o)")

    @property
    def work_dir(self) -> str:
        """Where requests.parquet and the shards go."""
        return (self.output_dir or f"{self.output_file}.parts").rstrip("/")


@dataclass(frozen=True)
class BatchGenerateConfig(GenerateJobConfig):
    """The generate job of a batch file: both prompt columns, a row uses the one it fills."""

    def __post_init__(self) -> None:
        if self.speculative.speculative == "draft" and not self.speculative.draft_model:
            raise ValueError("--speculative draft needs --draft-model")


@dataclass
class BatchPlan:
    """A batch file's parsed lines, and the generate job of its runnable ones (None: no line can run)."""

    batch: BatchFileConfig
    model: str
    lines: list[tuple[str | None, BatchRequest | LineError]]
    job: Job | None
    tokenizer: Callable[[], Any]  # loads the model's tokenizer (for logprobs' token strings)


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def read_text(uri: str) -> str:
    """A whole text file, local or remote; `ValueError` naming it when it cannot be read."""
    try:
        fs, path = _filesystem(uri)
        with fs.open_input_stream(path) as stream:
            return stream.read().decode()
    except (OSError, pa.ArrowException, UnicodeDecodeError) as error:
        raise ValueError(f"--input-file {uri}: cannot be read ({error})") from None


def requests_table(requests: list[BatchRequest]) -> pa.Table:
    """The runnable lines as the job's input rows."""
    columns = {f.name: [getattr(r, f.name) for r in requests] for f in REQUEST_SCHEMA}
    return pa.Table.from_pydict(columns, schema=REQUEST_SCHEMA)


def prepare_batch(batch: BatchFileConfig, sections: dict[str, Any]) -> BatchPlan:
    """Parse the input, write WORK/requests.parquet and build the generate job over it (`sections`: the model,
    sampling, chat, speculative and scaling sections; the sampling flags are the defaults a line's body overrides)."""
    from pipeline.generate import build_generate_job
    from pipeline.structured import model_tokenizer

    sampling = sections["sampling"]
    lines = parse_lines(read_text(batch.input_file), default_n=sampling.n)
    requests = [r for _, r in lines if isinstance(r, BatchRequest)]
    model = sections["model"]
    job = None
    if requests:
        work = OutputDir(batch.work_dir)
        work.create()
        work.write_table(REQUESTS_FILE, requests_table(requests), {})
        config = BatchGenerateConfig(
            input=InputConfig(
                input=f"{batch.work_dir}/{REQUESTS_FILE}",
                prompt_column="prompt",
                messages_column="messages",
                sampling_params_column="sampling_params",
            ),
            model=model,
            sampling=dataclasses.replace(sampling, n=max(r.n for r in requests)),
            chat=sections["chat"],
            speculative=sections["speculative"],
            scaling=sections["scaling"],
            output=OutputConfig(output=f"{batch.work_dir}/shards", overwrite=batch.overwrite),
        )
        job = build_generate_job(config)
    revision = job.worker.revision if job is not None else None
    return BatchPlan(batch, model.model, lines, job, lambda: model_tokenizer(model.model, revision))


def _job_rows(plan: BatchPlan) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(input row, its output rows in sample order) per job row, in row order, one shard file at a time."""
    shards = OutputDir(f"{plan.batch.work_dir}/shards")
    n = plan.job.samples_per_row
    for shard in plan.job.plan:
        rows = shards.read_table(shard.file_name).to_pylist()
        for start in range(0, len(rows), n):
            yield rows[start], rows[start : start + n]


def _created(plan: BatchPlan) -> int:
    """The job's first start, as the Unix time OpenAI's `created` is (0 when no line ran)."""
    if plan.job is None:
        return 0
    started = OutputDir(f"{plan.batch.work_dir}/shards").read_json(MANIFEST)["started_at"]
    return int(datetime.strptime(started, "%Y-%m-%dT%H:%M:%S%z").timestamp())


def output_lines(plan: BatchPlan) -> Iterator[dict[str, Any]]:
    """One output line per input line, in input order."""
    rows = _job_rows(plan) if plan.job is not None else iter(())
    created, tokenizer = _created(plan), None

    def decode(token_id: int) -> str:
        nonlocal tokenizer
        tokenizer = tokenizer or plan.tokenizer()
        return tokenizer.decode([token_id], skip_special_tokens=False)  # a special token is spelled too

    for line, (custom_id, request) in enumerate(plan.lines):
        if isinstance(request, LineError):
            yield error_line(custom_id, line, str(request))
            continue
        row, samples = next(rows)
        assert row["line"] == line, (row["line"], line)  # the job's rows are the runnable lines, in order
        yield response_line(row, samples, plan.model, created, decode)


def write_output(plan: BatchPlan) -> dict[str, int]:
    """Write the output JSONL (temporary name, then renamed); counts of lines that ran and that failed."""
    fs, path = _filesystem(plan.batch.output_file)
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    if parent:
        fs.create_dir(parent, recursive=True)
    temporary = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp" if parent else f".{name}.{uuid.uuid4().hex}.tmp"
    counts = {"completed": 0, "failed": 0}
    with fs.open_output_stream(temporary) as stream:
        for line in output_lines(plan):
            counts["completed" if line["error"] is None else "failed"] += 1
            stream.write((json.dumps(line, ensure_ascii=False) + "\n").encode())
    fs.move(temporary, path)
    return counts
