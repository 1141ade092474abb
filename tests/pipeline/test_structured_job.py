"""Structured-outputs flags of the generation job: parsed and checked before any worker starts, recorded in the
manifest and the resume fingerprint, and every output row valid end to end."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pipeline.cli import parse_sections
from pipeline.config import SamplingConfig
from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.output import MANIFEST
from pipeline.structured import resolve_constraint
from tests.pipeline.conftest import job_config, read_output
from tests.workers.structured_fixtures import ascii_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ascii_model(tmp_path_factory):
    return ascii_checkpoint("granite_dense", tmp_path_factory.mktemp("granite_ascii"))


def _sampling(argv: list[str]) -> SamplingConfig:
    return parse_sections("test", {"sampling": SamplingConfig}, argv)["sampling"]


def test_flags_parse_and_files_are_read(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA, indent=2))
    grammar_file = tmp_path / "g.ebnf"
    grammar_file.write_text('root ::= "yes" | "no"\n')
    assert _sampling(["--choice", "yes", "--choice", "no"]).choice == ("yes", "no")
    resolved, constraint = resolve_constraint(_sampling(["--json-schema", str(schema_file)]))
    assert constraint.json == SCHEMA and json.loads(resolved.json_schema) == SCHEMA  # the manifest gets the schema
    _, constraint = resolve_constraint(_sampling(["--json-schema", json.dumps(SCHEMA)]))
    assert constraint.json == SCHEMA
    resolved, constraint = resolve_constraint(_sampling(["--grammar", str(grammar_file)]))
    assert constraint.grammar == resolved.grammar == 'root ::= "yes" | "no"\n'
    assert resolve_constraint(_sampling(["--regex", "[a-z]+"]))[1].regex == "[a-z]+"
    assert resolve_constraint(_sampling([]))[1] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--regex", "a", "--choice", "b"], "at most one of --json-schema, --regex, --choice, --grammar"),
        (["--json-schema", "not/a/file.json"], "neither a file nor valid JSON"),
        (["--json-schema", "[1, 2]"], "must be an object"),
        (["--grammar", "missing.ebnf"], "no such file"),
        (["--choice", ""], "--choice: "),
    ],
)
def test_bad_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        resolve_constraint(_sampling(argv))


def test_a_constraint_that_cannot_compile_fails_before_any_worker(ascii_model, dataset, tmp_path):
    with pytest.raises(ValueError, match="--regex: structured_outputs.regex cannot be compiled"):
        build_generate_job(job_config(ascii_model, dataset, tmp_path, regex="a(", max_tokens=24))
    with pytest.raises(ValueError, match="--json-schema: .*frob"):
        build_generate_job(job_config(ascii_model, dataset, tmp_path, json_schema='{"type": "frob"}'))


@pytest.mark.slow
def test_json_schema_job_end_to_end_and_resume_refuses_another_schema(ascii_model, dataset, tmp_path, ray_session):
    options = dict(max_tokens=24, num_workers=1, max_model_len=200)
    config = job_config(ascii_model, dataset, tmp_path, json_schema=json.dumps(SCHEMA), **options)
    run(build_generate_job(config))
    rows = [row for row in read_output(tmp_path) if not row["error"]]
    assert len(rows) > 40
    for row in rows:
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["generated_text"]), SCHEMA)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert json.loads(manifest["fingerprint"]["sampling"]["json_schema"]) == SCHEMA
    other = json.dumps({**SCHEMA, "required": ["ok"]})
    with pytest.raises(ValueError, match=r"different job \(sampling.json_schema"):
        run(build_generate_job(job_config(ascii_model, dataset, tmp_path, json_schema=other, **options)))
