"""A generation job's structured-outputs flags → the workers' `StructuredOutputsParams`, checked on the driver.

`--json-schema` (a file or inline JSON), `--regex`, `--choice` (repeated) or `--grammar` (a file): at most one. The
files are read here, once, and the config then carries the constraint itself, so the manifest records it and a
rerun with another constraint (or an edited file) refuses to resume like any other difference. The constraint is
compiled with the model's tokenizer before any worker starts: a bad schema, regex or grammar fails the job then.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pipeline.config import STRUCTURED_OUTPUT_FLAGS, SamplingConfig
from workers.structured_outputs import GrammarCompilerCache, StructuredOutputsParams
from workers.tokenizer import load_tokenizer


def resolve_constraint(sampling: SamplingConfig) -> tuple[SamplingConfig, StructuredOutputsParams | None]:
    """(the sampling section with file flags replaced by their contents, the constraint or None); `ValueError`
    naming the flag."""
    if sampling.json_schema:
        text = sampling.json_schema
        path = Path(text).expanduser()
        if not text.lstrip().startswith("{") and path.is_file():
            text = path.read_text()
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--json-schema {sampling.json_schema!r}: neither a file nor valid JSON ({error})"
            ) from None
        if not isinstance(schema, dict):
            raise ValueError(f"--json-schema {sampling.json_schema!r}: a JSON schema must be an object")
        return dataclasses.replace(sampling, json_schema=json.dumps(schema)), StructuredOutputsParams(json=schema)
    if sampling.grammar:
        path = Path(sampling.grammar).expanduser()
        if not path.is_file():
            raise ValueError(f"--grammar {sampling.grammar!r}: no such file (give an EBNF grammar file)")
        text = path.read_text()
        return dataclasses.replace(sampling, grammar=text), _constraint("grammar", grammar=text)
    if sampling.regex:
        return sampling, _constraint("regex", regex=sampling.regex)
    if sampling.choice:
        return sampling, _constraint("choice", choice=sampling.choice)
    return sampling, None


def _constraint(flag: str, **kwargs: object) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as error:
        raise ValueError(f"--{flag}: {error}") from None


def sampling_fields(sampling: SamplingConfig) -> dict[str, object]:
    """The sampling section's fields that `SamplingParams` takes as they are (the constraint flags aside)."""
    return {k: v for k, v in dataclasses.asdict(sampling).items() if k not in STRUCTURED_OUTPUT_FLAGS}


def check_constraint(constraint: StructuredOutputsParams, model: str, revision: str | None) -> None:
    """Compile the constraint as the workers will, over the model's tokenizer (a hub model's at `revision`, the
    commit `check_model` resolved); `ValueError` naming the flag when it cannot compile."""
    tokenizer = model_tokenizer(model, revision)
    if tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer, and the model ships none")
    try:
        GrammarCompilerCache(tokenizer, len(tokenizer)).compile(constraint)
    except ValueError as error:
        flag = {"json": "--json-schema"}.get(constraint.kind, f"--{constraint.kind}")
        raise ValueError(f"{flag}: {error}") from None


def model_tokenizer(model: str, revision: str | None) -> Any:
    """The model's tokenizer as the workers load it (a hub model's at the commit `revision`), or None."""
    if Path(model).expanduser().is_dir():
        return load_tokenizer(Path(model).expanduser())
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=False)
