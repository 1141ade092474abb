"""OpenAI batch input lines → rows and per-row parameters, and `jobs/run_batch.py`'s flag errors (no Ray, no model)."""

from __future__ import annotations

import json

import pytest

from jobs.run_batch import main as run_batch_main
from pipeline.openai_batch import BatchRequest, LineError, body_sampling_params, parse_lines
from workers import SamplingParams
from workers.row_params import override_sampling


def _line(custom_id: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_body_fields_become_sampling_params_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": "m",
        "user": "u",
        "messages": [],
        "max_completion_tokens": 9,
        "temperature": 0.3,
        "top_p": 0.9,
        "stop": "x",
        "seed": 4,
        "logprobs": True,
        "top_logprobs": 3,
        "top_k": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    fields = body_sampling_params(body, chat=True)
    params = override_sampling(SamplingParams(), fields, "sampling_params")
    assert (params.max_tokens, params.temperature, params.top_p, params.stop, params.seed) == (9, 0.3, 0.9, ("x",), 4)
    assert (params.logprobs, params.top_k, params.structured_outputs.json) == (3, 5, schema)
    assert body_sampling_params({"logprobs": 2}, chat=False) == {"logprobs": 2}
    assert body_sampling_params({"logprobs": False}, chat=True) == {"logprobs": None}  # over --logprobs
    assert body_sampling_params({"response_format": {"type": "json_object"}}, chat=True) == {
        "structured_outputs": {"json": {"type": "object"}}
    }
    assert body_sampling_params({"response_format": {"type": "text"}}, chat=True) == {}


@pytest.mark.parametrize(
    "body, message",
    [
        ({"top_logprobs": 2}, "top_logprobs needs body.logprobs = true"),
        ({"logprobs": 2}, "body.logprobs=2 is invalid"),
        ({"response_format": {"type": "yaml"}}, "response_format.type='yaml' is invalid"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema.schema must be"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, message):
    with pytest.raises(LineError, match=message.replace("(", r"\(").replace("[", r"\[")):
        body_sampling_params(body, chat=True)


def test_lines_parse_in_order_and_bad_lines_are_errors():
    text = "\n".join(
        [
            _line("a", prompt="the cat", n=2, temperature=0),
            "",  # blank lines are not lines
            "[1, 2]",
            _line("b", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
            _line("a", prompt="again"),
            json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}),
            _line("d", prompt=["two", "prompts"]),
            _line("e", prompt="x", n=0),
            _line("f", prompt="x", echo=True),
        ]
    )
    parsed = parse_lines(text)
    assert [custom_id for custom_id, _ in parsed] == ["a", None, "b", "a", "c", "d", "e", "f"]
    first, chat = parsed[0][1], parsed[2][1]
    assert isinstance(first, BatchRequest) and (first.line, first.prompt, first.messages, first.n) == (
        0,
        "the cat",
        None,
        2,
    )
    assert json.loads(first.sampling_params) == {"temperature": 0}
    assert isinstance(chat, BatchRequest) and json.loads(chat.messages) == [{"role": "user", "content": "hi"}]
    assert chat.prompt is None and chat.n == 1
    messages = [str(r) for _, r in parsed if isinstance(r, LineError)]
    assert messages == [
        "line 2 is not a JSON object",
        "custom_id 'a' is used by an earlier line",
        "method 'GET' is not supported: only POST",
        "body.prompt must be a string (one prompt per line)",
        "body.n=0 is invalid: must be an integer ≥ 1",
        "body.echo is not supported",
    ]


def test_run_batch_flags_are_checked_before_anything_runs(tmp_path, capsys):
    assert run_batch_main(["-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path)]) == 2
    assert "--input-file" in capsys.readouterr().err
    assert run_batch_main(["-i", str(tmp_path / "none.jsonl"), "-o", "o.jsonl", "--model", str(tmp_path)]) == 2
    assert "cannot be read" in capsys.readouterr().err
