"""A job as the driver sees it: rows, shard plan, worker spec, output schema, identity for resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow as pa

from pipeline.config import ModelConfig, OutputConfig, ScalingConfig
from pipeline.fit import FitRequest
from pipeline.sharding import Shard
from workers.actor import ShardOutput, WorkerSpec
from workers.config import CacheConfig, EngineConfig, ExecutionConfig, LoadConfig, ParallelConfig, SchedulerConfig
from workers.spec_decode import SpeculativeConfig


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
    ids: pa.ChunkedArray | None = None  # the id column as written (`pipeline/ids.py`); None: the row index
    fit: FitRequest | None = None  # the sizing the driver checks on the cluster's GPU types (None: done or CPU)

    @property
    def input_columns(self) -> list[str]:
        """Input columns copied to the output (an input column named `id` that is the id column becomes `id`)."""
        return [name for name in self.rows.column_names if not (name == "id" and self.id_column == "id")]

    @property
    def samples_per_row(self) -> int:
        """Output rows per input row: a generate job's `--n` samples, else 1."""
        return self.worker.sampling.n if self.worker.sampling is not None else 1

    @property
    def schema(self) -> pa.Schema:
        """Output schema: `id`, every input column, then the task's columns."""
        input_schema = self.rows.data.table.schema
        id_type = self.ids.type if self.ids is not None else pa.int64()
        copied = [input_schema.field(name) for name in self.input_columns]
        return pa.schema([pa.field("id", id_type), *copied, *self.task_fields])

    def shard_rows(self, shard: Shard) -> pa.Table:
        """The input rows of one shard as an Arrow table."""
        return self.rows.select(range(shard.start, shard.stop)).data.table.combine_chunks()

    def output_table(self, shard: Shard, rows: pa.Table, result: ShardOutput) -> pa.Table:
        """Input rows + id + the worker's columns, in the job's schema: with `--n` samples, each input row repeated
        once per sample (row-major), every (id, sample_index) pair exactly once, checked."""
        schema, n = self.schema, self.samples_per_row
        if self.ids is None:
            ids = pa.array(range(shard.start, shard.stop), pa.int64())
        else:
            ids = self.ids.slice(shard.start, shard.num_rows)
        arrays = [ids, *(readable(rows.column(name)) for name in self.input_columns)]
        if n > 1:
            samples = result.columns.get("sample_index")
            if samples != list(range(n)) * shard.num_rows:
                raise RuntimeError(f"shard {shard.index}: the worker's samples are not {n} per row in order")
            repeated = pa.array([row for row in range(shard.num_rows) for _ in range(n)], pa.int64())
            arrays = [array.take(repeated) for array in arrays]
        arrays += [pa.array(result.columns[f.name], type=f.type) for f in self.task_fields]
        return pa.Table.from_arrays(arrays, schema=schema)


def engine_config(
    model: ModelConfig,
    revision: str | None = None,
    speculative: SpeculativeConfig | None = None,
    scaling: ScalingConfig | None = None,
) -> EngineConfig:
    """The workers' engine config, built once from the job's model section (a hub model at the commit `revision`,
    resolved by the driver), its speculative config and the scaling section's tensor / expert parallelism."""
    quantization = None if model.quantization == "none" else model.quantization
    scaling = scaling or ScalingConfig()
    return EngineConfig(
        load=LoadConfig(device=model.device, dtype=model.dtype, quantization=quantization, revision=revision),
        scheduler=SchedulerConfig(model.max_num_seqs, model.max_num_batched_tokens, model.max_model_len),
        cache=CacheConfig(model.enable_prefix_caching, model.max_memory, model.gpu_memory_utilization),
        execution=ExecutionConfig(cuda_graphs=False if model.enforce_eager else None),
        parallel=ParallelConfig(
            tensor_parallel_size=scaling.tensor_parallel_size, enable_expert_parallel=scaling.enable_expert_parallel
        ),
        speculative=speculative,
    )


def worker_spec(
    task: str,
    model: ModelConfig,
    revision: str | None = None,
    speculative: SpeculativeConfig | None = None,
    scaling: ScalingConfig | None = None,
    **task_fields: Any,
) -> WorkerSpec:
    """The `WorkerSpec` of a job's workers (generate and score alike): the engine config built from the model and
    scaling sections and the speculative config, plus the task's typed options (`prompt`, `sampling` or
    `scoring`)."""
    return WorkerSpec(task, model.model, engine_config(model, revision, speculative, scaling), **task_fields)


def readable(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """An input column as the output copies it: text that is not valid UTF-8 (pyarrow's JSON reader lets it through;
    that row's `error` says so) with each bad byte replaced by U+FFFD, so that every reader can read the file."""
    storage = getattr(column.type, "storage_type", column.type)
    if not (pa.types.is_string(storage) or pa.types.is_large_string(storage)):
        return column
    try:
        column.validate(full=True)
        return column
    except pa.ArrowInvalid:
        binary = pa.large_binary() if pa.types.is_large_string(storage) else pa.binary()
        values = column.cast(storage).cast(binary).to_pylist()
        texts = [None if v is None else v.decode("utf-8", errors="replace") for v in values]
        return pa.chunked_array([pa.array(texts, storage)]).cast(column.type)


def read_input(source: str, split: str, id_column: str | None = None) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The input rows and their identity, from the same bytes: a remote input is copied once (its `datasets` cache
    beside the copy, both removed when the driver exits), a hub dataset is read at the commit its branch points to
    now. `id_column`: a CSV column read as written (see `load_rows`)."""
    from pipeline.identity import input_identity
    from pipeline.inputs import hub_dataset_revision, input_files, load_rows
    from pipeline.remote import is_remote, local_copy, scratch_directory

    local, cache_dir = source, None
    if is_remote(source):
        local, cache_dir = local_copy(source), scratch_directory("hybridgen-datasets-cache-")
    revision = hub_dataset_revision(local) if input_files(local) is None else None
    rows = load_rows(local, split, revision, cache_dir=cache_dir, id_column=id_column)
    return rows, input_identity(rows, local, revision)


def build_job(
    name: str,
    config: Any,
    source: tuple[str, str],
    columns: dict[str, str | None],
    id_column: str | None,
    worker: WorkerSpec,
    task_fields: list[pa.Field],
    fit: FitRequest | None = None,
) -> Job:
    """Read and check the input (before any worker starts), plan the shards and describe the job.

    `config` is the job's config dataclass (with `model`, `scaling` and `output` sections); `source` is
    (input, split); `columns` maps each column flag to the column it names; `fit`: the preflight sizing left for the
    driver (`pipeline/fit.py`).
    """
    from pipeline.identity import model_identity
    from pipeline.ids import read_ids
    from pipeline.inputs import check_columns
    from pipeline.sharding import plan_shards

    rows, input_identity = read_input(*source, id_column=id_column)
    flag = f"--id-column {id_column!r}"
    if id_column is None and "id" in rows.column_names:
        id_column, flag = "id", "the input's `id` column (the output `id`)"  # unless --id-column names another
    reserved = ("id",) * (id_column != "id") + tuple(f.name for f in task_fields)
    check_columns(rows, columns, reserved=reserved)
    ids = read_ids(rows, id_column, flag)
    fingerprint = config.to_dict()
    fingerprint.pop("output")
    # --tensor-parallel-size and --enable-expert-parallel are left out, as --device and --max-num-seqs are: they
    # change the order of float sums (a rank-ordered all-reduce), not what is computed, so a resumed job may run on
    # another layout (the manifest's config records each run's). docs/tensor_parallel.md says why.
    fingerprint["scaling"] = {"rows_per_shard": config.scaling.rows_per_shard}
    fingerprint["model"].pop("revision")  # the files at the commit it resolved to are in model_identity
    for performance_only in (
        "device",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_memory",
        "gpu_memory_utilization",
        "gpu_memory",
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
        ids=ids,
        fit=fit,
    )
