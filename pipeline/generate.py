"""Build a generation job from its config."""

from __future__ import annotations

import dataclasses

from pipeline.chat import chat_options, resolve_chat_template
from pipeline.config import GenerateJobConfig
from pipeline.fit import check_job_fit
from pipeline.job import Job, build_job, worker_spec
from pipeline.preflight import check_model
from pipeline.structured import check_constraint, resolve_constraint, sampling_fields
from workers.rows import PromptSource, generation_fields
from workers.sampling import SamplingParams
from workers.spec_decode import SpeculativeConfig


def speculative_config(config: GenerateJobConfig, draft_revision: str | None = None) -> SpeculativeConfig | None:
    """The workers' `SpeculativeConfig` (a hub draft model at the commit `draft_revision`), or None for plain
    decoding."""
    options = config.speculative
    if options.speculative == "none":
        return None
    return SpeculativeConfig(
        method=options.speculative,
        num_speculative_tokens=options.num_speculative_tokens,
        draft_model=options.draft_model if options.speculative == "draft" else None,
        draft_revision=draft_revision,
        prompt_lookup_min=options.prompt_lookup_min,
        prompt_lookup_max=options.prompt_lookup_max,
        policy=options.speculative_policy,
    )


def build_generate_job(config: GenerateJobConfig) -> Job:
    """Validate everything that can be checked before a worker starts, then describe the job."""
    resolved, constraint = resolve_constraint(config.sampling)  # the config carries the constraint, not its file
    config = dataclasses.replace(config, sampling=resolved, chat=resolve_chat_template(config.chat))
    options = sampling_fields(config.sampling)
    logprobs_mode = options.pop("logprobs_mode")  # the engine's (`SamplerConfig`), not a request's
    # The same validation the workers apply, now.
    sampling = SamplingParams(**options, structured_outputs=constraint)
    # Hub models are checked, fingerprinted and loaded by every worker at the commit resolved here, once.
    revision = check_model(
        config.model.model, need_mtp=config.speculative.speculative == "mtp", revision=config.model.revision
    )
    if constraint is not None:
        check_constraint(constraint, config.model.model, revision)
    draft_revision = None
    if config.speculative.speculative == "draft":
        draft_revision = check_model(config.speculative.draft_model, "draft model", need_tokenizer=False)
    model, columns = config.model, config.input
    speculative = speculative_config(config, draft_revision)
    num_drafts = 0 if speculative is None else speculative.num_speculative_tokens
    fit = check_job_fit(model, config.scaling, revision, config.speculative.speculative == "mtp", num_drafts)
    prompt = PromptSource(
        columns.prompt_column, columns.messages_column, chat_options(config.chat), columns.sampling_params_column
    )
    worker = worker_spec("generate", model, revision, speculative, config.scaling, prompt=prompt, sampling=sampling)
    worker = dataclasses.replace(worker, engine=worker.engine.replace(logprobs_mode=logprobs_mode))
    fields = generation_fields(
        sampling.logprobs, prompt.chat, per_row_params=columns.sampling_params_column is not None
    )
    flags = {
        "--prompt-column": columns.prompt_column,
        "--messages-column": columns.messages_column,
        "--id-column": columns.id_column,
        "--sampling-params-column": columns.sampling_params_column,
    }
    source = (columns.input, columns.split)
    return build_job("generate", config, source, flags, columns.id_column, worker, fields, fit=fit)
