"""A Ray Data stage: hybridgen generation as one step of a user's `ray.data` pipeline, built and applied as Ray Data
LLM's `build_processor` is.

    config = HybridgenProcessorConfig(model_source="path/or/org-name", engine_kwargs={"max_num_seqs": 32},
                                      sampling_params={"temperature": 0, "max_tokens": 64}, concurrency=(1, 4))
    processor = build_processor(config, preprocess=lambda row: {"prompt": row["question"]})
    ds = processor(ray.data.read_parquet("questions/"))  # the input columns + the generate job's output columns

The stage is a Ray Data autoscaling actor pool (`concurrency=(min, max)`). Each actor loads one `ModelRunner` once
(`workers/actor.py`'s `ShardWorker`) and streams its batches through it: several batches are in flight per actor
(threaded calls), and a batch's rows join the running engine batch as slots free up (`workers/stream.py`), so an
actor never drains its batch between Ray Data batches. A bad row gets an `error` and the dataset goes on.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.preflight import check_model
from workers.actor import ShardWorker, WorkerSpec, die
from workers.columns import decode_rows
from workers.config import EngineConfig
from workers.model.distributed.group import RankFailure
from workers.rows import GENERATE_FIELDS, LOGPROBS_FIELDS, PromptSource, generation_columns, shard_requests
from workers.sampling import SamplingParams
from workers.spec_decode import SpeculativeConfig
from workers.stream import SHARDS_PER_WORKER

Row = dict[str, Any]


def _refuse(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"HybridgenProcessorConfig.{name}={value!r} is invalid: must be {allowed}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class HybridgenProcessorConfig:
    """The stage's configuration, in Ray Data LLM's names (`vLLMEngineProcessorConfig`) where they fit.

    `engine_kwargs`: `EngineConfig` options by name (`max_num_seqs`, `max_model_len`, `max_num_batched_tokens`,
    `enable_prefix_caching`, `device`, `dtype`, `quantization`, `tensor_parallel_size`, …) and vLLM's
    `speculative_config` (a dict of `SpeculativeConfig` fields) and `enforce_eager`. `sampling_params`: every row's
    `SamplingParams` fields. A row's prompt is its `prompt_column` text or its `messages_column` chat messages, as
    in the generate job; with a `seed`, row i samples with seed + i, i being the integer in `index_column` (Ray Data
    does not number rows, so a seeded stage needs that column)."""

    model_source: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_params: dict[str, Any] = field(default_factory=dict)
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    index_column: str | None = None
    concurrency: int | tuple[int, int] = 1  # actors: a fixed pool of n, or an autoscaling pool (min, max)
    batch_size: int = 32  # rows per Ray Data batch
    max_concurrent_batches: int = SHARDS_PER_WORKER  # batches streaming through one actor at once
    num_cpus: float = 1.0  # per rank (an actor with tensor_parallel_size T asks for T × num_cpus)
    runtime_env: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_source, str) or not self.model_source:
            _refuse("model_source", self.model_source, "a local model directory or a hub repo id")
        if (self.prompt_column is None) == (self.messages_column is None):
            _refuse("prompt_column", self.prompt_column, "set, or messages_column set instead (exactly one of them)")
        concurrency = self.concurrency
        fixed = _positive_int(concurrency)
        ranged = isinstance(concurrency, tuple) and len(concurrency) == 2 and all(map(_positive_int, concurrency))
        if not fixed and not (ranged and concurrency[0] <= concurrency[1]):
            _refuse("concurrency", concurrency, "an integer ≥ 1 or a tuple (min, max) of integers, 1 ≤ min ≤ max")
        for name in ("batch_size", "max_concurrent_batches"):
            if not _positive_int(getattr(self, name)):
                _refuse(name, getattr(self, name), "an integer ≥ 1")
        if not isinstance(self.num_cpus, (int, float)) or isinstance(self.num_cpus, bool) or self.num_cpus <= 0:
            _refuse("num_cpus", self.num_cpus, "a number > 0")
        for name in ("engine_kwargs", "sampling_params"):
            if not isinstance(getattr(self, name), dict):
                _refuse(name, getattr(self, name), "a dict of option names to values")

    @property
    def model(self) -> str:
        """The model (vLLM's name for `model_source`)."""
        return self.model_source


def engine_config(config: HybridgenProcessorConfig) -> EngineConfig:
    """The actors' engine config from `engine_kwargs`; `ValueError` / `TypeError` naming a bad option."""
    options = dict(config.engine_kwargs)
    speculative = options.pop("speculative_config", None)
    if options.pop("enforce_eager", False):
        options["cuda_graphs"] = False
    if isinstance(speculative, dict):
        speculative = SpeculativeConfig(**speculative)
    elif speculative is not None and not isinstance(speculative, SpeculativeConfig):
        _refuse("engine_kwargs['speculative_config']", speculative, "a dict of SpeculativeConfig fields or None")
    if speculative is not None:
        options["speculative"] = speculative
    return EngineConfig().replace(**options)


def sampling_params(config: HybridgenProcessorConfig) -> SamplingParams:
    """Every row's sampling; `ValueError` / `TypeError` naming a bad field (`SamplingParams`' own checks)."""
    params = SamplingParams(**config.sampling_params)
    if params.seed is not None and config.index_column is None:
        _refuse(
            "index_column",
            None,
            "the integer column whose value i seeds a row with seed + i (as the generate job's row i) when "
            "sampling_params has a seed: Ray Data does not number rows",
        )
    return params


def stage_spec(config: HybridgenProcessorConfig) -> WorkerSpec:
    """Check everything that can be checked before an actor starts (the config, the sampling, the engine options,
    the model directory or hub repo and the draft model), and describe the actors' work."""
    engine = engine_config(config)
    sampling = sampling_params(config)
    speculative = engine.speculative
    revision = check_model(config.model_source, need_mtp=speculative is not None and speculative.method == "mtp")
    if revision is not None:
        engine = engine.replace(revision=revision)  # every actor loads the commit checked here
    if speculative is not None and speculative.method == "draft":
        draft_revision = check_model(speculative.draft_model, "draft model", need_tokenizer=False)
        engine = engine.replace(speculative=dataclasses.replace(speculative, draft_revision=draft_revision))
    prompt = PromptSource(config.prompt_column, config.messages_column)
    return WorkerSpec("generate", config.model_source, engine, prompt=prompt, sampling=sampling)


def output_schema(sampling: SamplingParams) -> pa.Schema:
    """The columns the stage adds: the generate job's (`GENERATE_FIELDS`, and `LOGPROBS_FIELDS` with logprobs)."""
    return pa.schema(GENERATE_FIELDS + (LOGPROBS_FIELDS if sampling.logprobs is not None else []))


class GenerateStage:
    """The actor pool's UDF: `__init__` loads one runner per actor, `__call__` streams one Arrow batch through it.

    Calls overlap (Ray Data runs up to `max_concurrent_batches` per actor on threads); each submits its rows to the
    one `ShardStream` of the actor's `ShardWorker` and waits for its own rows only."""

    def __init__(self, spec: WorkerSpec, index_column: str | None = None):
        self.spec, self.index_column = spec, index_column
        self.worker = ShardWorker(spec)
        if self.worker.start_error is not None:  # Ray Data reports the actor's failure with this message
            raise RuntimeError(f"hybridgen stage could not load {spec.model!r}: {self.worker.start_error}")
        self._batch_ids = itertools.count()  # next() is atomic under the GIL: each call its own stream key

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The batch's input columns (repeated per sample with `n` > 1) and its output columns."""
        sampling = self.spec.sampling
        for name in self.spec.input_columns + ([self.index_column] if self.index_column else []):
            if name not in batch.column_names:
                raise KeyError(f"the hybridgen stage reads column {name!r}; the batch has {batch.column_names}")
        requests = self._requests(batch)
        try:
            results = self.worker.stream.submit(next(self._batch_ids), requests, batch.num_rows, sampling.n).result()
        except RankFailure as error:  # a split model lost a rank: the actor dies, Ray Data restarts it and retries
            die(f"{type(error).__name__}: {error}")
        columns = generation_columns(results, sampling.logprobs)
        schema = output_schema(sampling)
        if sampling.n > 1:
            batch = batch.take(pa.array([row for row in range(batch.num_rows) for _ in range(sampling.n)]))
        batch = batch.drop_columns([name for name in schema.names if name in batch.column_names])
        for f in schema:
            batch = batch.append_column(f, pa.array(columns[f.name], type=f.type))
        return batch

    def _requests(self, batch: pa.Table) -> Iterator[tuple[list[int] | str, SamplingParams | None]]:
        """Each row's (prompt token ids, sampling), or (why it cannot run, None), lazily on the engine thread; a
        seeded row samples with seed + its `index_column` value, as the generate job's row of that index does."""
        tokenizer, prompt, sampling = self.worker.runner.tokenizer, self.spec.prompt, self.spec.sampling
        rows = decode_rows(batch, self.spec.input_columns)
        if sampling.seed is None:
            yield from shard_requests(tokenizer, rows, prompt, sampling, 0)
            return
        for row, index in zip(rows, batch.column(self.index_column).to_pylist()):
            if not isinstance(index, int) or isinstance(index, bool):
                yield f"{self.index_column!r} must hold an integer row index to seed this row, got {index!r}", None
                continue
            yield next(shard_requests(tokenizer, [row], prompt, sampling, index))


def actor_options(config: HybridgenProcessorConfig, spec: WorkerSpec) -> dict[str, Any]:
    """What each actor asks of Ray: `num_cpus` per rank, and one GPU per rank on CUDA (a worker with
    `tensor_parallel_size` T starts its own T - 1 follower rank processes, on the GPUs Ray gives the actor)."""
    ranks = spec.engine.parallel.tensor_parallel_size
    options: dict[str, Any] = {
        "num_cpus": config.num_cpus * ranks,
        "num_gpus": ranks if spec.engine.load.device.startswith("cuda") else 0,
    }
    if config.runtime_env:
        options["runtime_env"] = config.runtime_env
    return options


class Processor:
    """A built stage: `processor(ds)` is `ds` with `preprocess` mapped over its rows, the generation columns added
    by the actor pool, then `postprocess` mapped (lazily, as every Ray Data transform)."""

    def __init__(
        self,
        config: HybridgenProcessorConfig,
        spec: WorkerSpec,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        preprocess_map_kwargs: dict[str, Any] | None = None,
        postprocess_map_kwargs: dict[str, Any] | None = None,
    ):
        self.config, self.spec = config, spec
        self.preprocess, self.postprocess = preprocess, postprocess
        self.preprocess_map_kwargs = preprocess_map_kwargs or {}
        self.postprocess_map_kwargs = postprocess_map_kwargs or {}

    def __call__(self, dataset: Any) -> Any:
        """The transformed `ray.data.Dataset`."""
        from ray.data import ActorPoolStrategy

        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess, **self.preprocess_map_kwargs)
        config, spec = self.config, self._placed_spec()
        low, high = config.concurrency if isinstance(config.concurrency, tuple) else (1, config.concurrency)
        depth = config.max_concurrent_batches
        compute = ActorPoolStrategy(
            min_size=low,
            max_size=high,
            # Twice the batches an actor runs: the next ones wait at the actor (their blocks fetched), and the
            # pool's utilization (tasks / slots) can pass Ray Data's upscaling threshold, 175 %, so (min, max) scales.
            max_tasks_in_flight_per_actor=2 * depth,
            max_concurrent_calls_per_actor=depth,
            enable_true_multi_threading=True,  # the calls share one engine thread (`ShardStream`), not the device
        )
        dataset = dataset.map_batches(
            GenerateStage,
            fn_constructor_args=(spec, config.index_column),
            batch_size=config.batch_size,
            batch_format="pyarrow",
            compute=compute,
            **actor_options(config, spec),
        )
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess, **self.postprocess_map_kwargs)
        return dataset

    def _placed_spec(self) -> WorkerSpec:
        """The spec with device "auto" resolved against the cluster (CUDA when it has GPUs) and, on CPU, each
        rank's torch threads set to its CPUs unless `engine_kwargs` sets them."""
        import ray

        engine = self.spec.engine
        if engine.load.device == "auto":
            gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
            engine = engine.replace(device="cuda" if gpus else "cpu")
        if not engine.load.device.startswith("cuda") and engine.parallel.num_threads is None:
            engine = engine.replace(num_threads=max(1, int(self.config.num_cpus)))
        return dataclasses.replace(self.spec, engine=engine)


def build_processor(
    config: HybridgenProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
) -> Processor:
    """The stage for `config`, as Ray Data LLM's `build_processor`: `preprocess` turns each input row into one with
    the prompt column (all columns are carried through the stage), `postprocess` each output row into what the
    pipeline keeps; the `*_map_kwargs` go to their `Dataset.map`. Everything that can be checked is checked here,
    before any actor starts: `ValueError` / `TypeError` naming the field."""
    return Processor(config, stage_spec(config), preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)
