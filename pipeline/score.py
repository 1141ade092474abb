"""Build a scoring job from its config."""

from __future__ import annotations

import dataclasses

from pipeline.fit import check_job_fit
from pipeline.job import Job, build_job, worker_spec
from pipeline.preflight import check_model
from pipeline.score_config import ScoreJobConfig
from workers.scoring import SCORE_FIELDS, TOKEN_LOGPROBS_FIELD, ScoreSpec


def build_score_job(config: ScoreJobConfig) -> Job:
    """Validate everything that can be checked before a worker starts, then describe the job."""
    columns, model = config.input, config.model
    revision = check_model(model.model, revision=model.revision)  # the hub commit every worker loads
    spec = ScoreSpec(
        text_column=columns.text_column,
        prompt_column=columns.prompt_column,
        completion_column=columns.completion_column,
        messages_column=columns.messages_column,
        **dataclasses.asdict(config.scoring),
    )
    fit = check_job_fit(model, config.scaling, revision)
    worker = worker_spec("score", model, revision, scaling=config.scaling, scoring=spec)
    flags = {"--text-column": columns.text_column, "--prompt-column": columns.prompt_column,
             "--completion-column": columns.completion_column, "--messages-column": columns.messages_column,
             "--id-column": columns.id_column}  # fmt: skip
    fields = SCORE_FIELDS + ([TOKEN_LOGPROBS_FIELD] if config.scoring.token_logprobs else [])
    source = (columns.input, columns.split)
    return build_job("score", config, source, flags, columns.id_column, worker, fields, fit=fit)
