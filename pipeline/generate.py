"""Build a generation job from its config: read and check the input, plan the shards, describe the workers."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.config import GenerateJobConfig
from pipeline.inputs import check_columns, load_rows
from pipeline.job import Job
from pipeline.sharding import plan_shards
from workers.actor import WorkerSpec
from workers.rows import GENERATE_FIELDS, PromptSource
from workers.sampling import SamplingParams
from workers.spec_decode import SpeculativeConfig

SECTIONS = ("input", "model", "sampling", "speculative", "scaling", "output")


def speculative_config(config: GenerateJobConfig) -> SpeculativeConfig | None:
    """The workers' `SpeculativeConfig`, or None for plain decoding."""
    options = config.speculative
    if options.speculative == "none":
        return None
    return SpeculativeConfig(
        method=options.speculative,
        num_speculative_tokens=options.num_speculative_tokens,
        draft_model=options.draft_model,
        prompt_lookup_min=options.prompt_lookup_min,
        prompt_lookup_max=options.prompt_lookup_max,
    )


def build_generate_job(config: GenerateJobConfig) -> Job:
    """Validate everything that can be checked before a worker starts, then describe the job."""
    sampling: dict[str, Any] = dataclasses.asdict(config.sampling)
    SamplingParams(**sampling)  # the same validation the workers apply, now
    speculative = speculative_config(config)
    rows = load_rows(config.input.input, config.input.split)
    required = {
        "--prompt-column": config.input.prompt_column,
        "--messages-column": config.input.messages_column,
        "--id-column": config.input.id_column,
    }
    check_columns(rows, required, reserved=("id", *(f.name for f in GENERATE_FIELDS)))
    model = config.model
    worker = WorkerSpec(
        task="generate",
        model=model.model,
        device=model.device,
        dtype=model.dtype,
        max_num_seqs=model.max_num_seqs,
        max_model_len=model.max_model_len,
        speculative=speculative,
        prompt=PromptSource(config.input.prompt_column, config.input.messages_column),
        task_options=sampling,
    )
    fingerprint = config.to_dict()
    fingerprint.pop("output")
    fingerprint["scaling"] = {"rows_per_shard": config.scaling.rows_per_shard}
    for performance_only in ("device", "max_num_seqs"):
        fingerprint["model"].pop(performance_only)
    return Job(
        name="generate",
        rows=rows,
        worker=worker,
        task_fields=GENERATE_FIELDS,
        id_column=config.input.id_column,
        plan=plan_shards(len(rows), config.scaling.rows_per_shard),
        scaling=config.scaling,
        output=config.output,
        config=config.to_dict(),
        fingerprint=fingerprint,
    )
