"""A job as the driver sees it: rows, shard plan, worker spec, output schema, identity for resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow as pa

from pipeline.config import ModelConfig, OutputConfig, ScalingConfig
from pipeline.sharding import Shard
from workers.actor import ShardOutput, WorkerSpec


@dataclass
class Job:
    """Everything the driver needs to run one generate or score job."""

    name: str
    rows: datasets.Dataset
    worker: WorkerSpec
    task_fields: list[pa.Field]  # the columns the workers add
    id_column: str | None
    plan: list[Shard]
    scaling: ScalingConfig
    output: OutputConfig
    config: dict[str, Any]  # the full job config, for the manifest
    fingerprint: dict[str, Any]  # what must match for a rerun to resume

    @property
    def input_columns(self) -> list[str]:
        """Input columns copied to the output (an input column named `id` that is the id column becomes `id`)."""
        return [name for name in self.rows.column_names if not (name == "id" and self.id_column == "id")]

    @property
    def schema(self) -> pa.Schema:
        """Output schema: `id`, every input column, then the task's columns."""
        input_schema = self.rows.data.table.schema
        id_type = input_schema.field(self.id_column).type if self.id_column else pa.int64()
        copied = [input_schema.field(name) for name in self.input_columns]
        return pa.schema([pa.field("id", id_type), *copied, *self.task_fields])

    def shard_rows(self, shard: Shard) -> pa.Table:
        """The input rows of one shard as an Arrow table."""
        return self.rows.select(range(shard.start, shard.stop)).data.table.combine_chunks()

    def output_table(self, shard: Shard, rows: pa.Table, result: ShardOutput) -> pa.Table:
        """Input rows + id + the worker's columns, in the job's schema."""
        schema = self.schema
        ids = rows.column(self.id_column) if self.id_column else pa.array(range(shard.start, shard.stop), pa.int64())
        arrays = [ids, *(rows.column(name) for name in self.input_columns)]
        arrays += [pa.array(result.columns[f.name], type=f.type) for f in self.task_fields]
        return pa.Table.from_arrays(arrays, schema=schema)


def worker_spec(task: str, model: ModelConfig, revision: str | None = None, **task_fields: Any) -> WorkerSpec:
    """The `WorkerSpec` of a job's workers: the model section (a hub model at the commit `revision`, resolved by
    the driver) plus task-specific fields."""
    quantization = None if model.quantization == "none" else model.quantization
    return WorkerSpec(task=task, model=model.model, revision=revision, device=model.device, dtype=model.dtype,
                      quantization=quantization,
                      max_num_seqs=model.max_num_seqs, max_model_len=model.max_model_len,
                      max_num_batched_tokens=model.max_num_batched_tokens, max_memory=model.max_memory,
                      gpu_memory_utilization=model.gpu_memory_utilization, enforce_eager=model.enforce_eager,
                      enable_prefix_caching=model.enable_prefix_caching, **task_fields)  # fmt: skip


def read_input(source: str, split: str) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The input rows and their identity, from the same bytes: a remote input is copied once, a hub dataset is
    read at the commit its branch points to now."""
    from pipeline.identity import input_identity
    from pipeline.inputs import hub_dataset_revision, input_files, load_rows
    from pipeline.remote import is_remote, local_copy

    local = local_copy(source) if is_remote(source) else source
    revision = hub_dataset_revision(local) if input_files(local) is None else None
    rows = load_rows(local, split, revision)
    return rows, input_identity(rows, local, revision)


def build_job(
    name: str,
    config: Any,
    source: tuple[str, str],
    columns: dict[str, str | None],
    id_column: str | None,
    worker: WorkerSpec,
    task_fields: list[pa.Field],
) -> Job:
    """Read and check the input (before any worker starts), plan the shards and describe the job.

    `config` is the job's config dataclass (with `model`, `scaling` and `output` sections); `source` is
    (input, split); `columns` maps each column flag to the column it names.
    """
    from pipeline.identity import model_identity
    from pipeline.inputs import check_columns
    from pipeline.sharding import plan_shards

    rows, input_identity = read_input(*source)
    if id_column is None and "id" in rows.column_names:
        id_column = "id"  # an input `id` column is the output `id` unless --id-column names another
    reserved = ("id",) * (id_column != "id") + tuple(f.name for f in task_fields)
    check_columns(rows, columns, reserved=reserved)
    fingerprint = config.to_dict()
    fingerprint.pop("output")
    fingerprint["scaling"] = {"rows_per_shard": config.scaling.rows_per_shard}
    fingerprint["model"].pop("revision")  # the files at the commit it resolved to are in model_identity
    for performance_only in (
        "device",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_memory",
        "gpu_memory_utilization",
        "enforce_eager",
        "enable_prefix_caching",
    ):
        fingerprint["model"].pop(performance_only)
    # What decides the output beyond the flags: weights, tokenizer, draft model and input contents.
    fingerprint["model_identity"] = model_identity(worker.model, worker.revision)
    if worker.speculative is not None and worker.speculative.draft_model:
        draft = worker.speculative
        fingerprint["draft_model_identity"] = model_identity(draft.draft_model, draft.draft_revision)
    fingerprint["input_identity"] = input_identity
    return Job(
        name=name,
        rows=rows,
        worker=worker,
        task_fields=task_fields,
        id_column=id_column,
        plan=plan_shards(len(rows), config.scaling.rows_per_shard),
        scaling=config.scaling,
        output=config.output,
        config=config.to_dict(),
        fingerprint=fingerprint,
    )
