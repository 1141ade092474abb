"""Per-row sampling parameters (`--sampling-params-column`): rows with different parameters in one batch each get
what the row run alone with those parameters, written out by hand, gets; a bad value fails its own row, naming
the field."""

from __future__ import annotations

import json
import re

import pytest

from tests.workers.structured_fixtures import ascii_checkpoint
from workers import ModelRunner, SamplingParams, StructuredOutputsParams
from workers.row_params import override_sampling, row_sampling
from workers.rows import PromptSource, generate_shard

BASE = SamplingParams(temperature=0.9, seed=100, max_tokens=10, ignore_eos=True)
SOURCE = PromptSource(prompt_column="text", sampling_params_column="params")
# (row's params column value, the SamplingParams the row must behave as, written out independently of the code)
MIXED = [
    (None, SamplingParams(temperature=0.9, seed=100, max_tokens=10, ignore_eos=True)),
    ({"temperature": 0.0, "max_tokens": 6}, SamplingParams(temperature=0.0, seed=101, max_tokens=6, ignore_eos=True)),
    ('{"seed": 7, "top_k": 5}', SamplingParams(temperature=0.9, seed=7, top_k=5, max_tokens=10, ignore_eos=True)),
    (
        {"structured_outputs": {"regex": "[0-9]{3}"}, "ignore_eos": False, "temperature": 1.2},
        SamplingParams(
            temperature=1.2, seed=103, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")
        ),
    ),
    (
        {"guided_choice": ["yes", "no"], "ignore_eos": False, "logprobs": 2},
        SamplingParams(
            temperature=0.9,
            seed=104,
            max_tokens=10,
            logprobs=2,
            structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
        ),
    ),
    (
        {"stop": ["a"], "top_p": 0.5, "max_tokens": 12},
        SamplingParams(temperature=0.9, seed=105, top_p=0.5, stop=("a",), max_tokens=12, ignore_eos=True),
    ),
    (
        {
            "structured_outputs": {"json": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "ignore_eos": False,
            "max_tokens": 24,
        },
        SamplingParams(
            temperature=0.9,
            seed=106,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(
                json={"type": "object", "properties": {"x": {"type": "integer"}}}
            ),
        ),
    ),
]
PROMPTS = ["hello", "cat 12", '{"a": 1', "true", "world", "null null", "age"]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = ascii_checkpoint("granite_dense", tmp_path_factory.mktemp("row_params"))
    return ModelRunner.from_pretrained(str(path), max_num_seqs=4)


def test_mixed_rows_in_one_batch_equal_each_row_run_alone(runner):
    rows = [{"text": text, "params": value} for text, (value, _) in zip(PROMPTS, MIXED)]
    columns = generate_shard(runner, rows, SOURCE, BASE, first_row=0)
    assert columns["error"] == [None] * len(rows)
    for i, (text, (_, expected)) in enumerate(zip(PROMPTS, MIXED)):
        alone = runner.generate([runner.tokenizer.encode(text)], expected)[0]
        assert columns["generated_token_ids"][i] == alone.token_ids, i
        assert columns["finish_reason"][i] == alone.finish_reason, i
        if expected.logprobs is None:
            assert columns["logprobs"][i] is None
        else:
            assert columns["logprobs"][i] == pytest.approx([e[t] for t, e in zip(alone.token_ids, alone.logprobs)])
            assert all(len(top) == 2 for top in columns["top_logprobs"][i])
    assert re.fullmatch("[0-9]{3}", columns["generated_text"][3]) or columns["finish_reason"][3] == "length"
    assert columns["generated_text"][4] in ("yes", "no")
    assert len(columns["generated_token_ids"][1]) == 6  # greedy, its own max_tokens


BAD = [
    ({"temprature": 0.5}, "params.temprature: not a SamplingParams field"),
    ({"max_tokens": "ten"}, "SamplingParams.max_tokens='ten' is invalid"),
    ({"top_p": 2}, "SamplingParams.top_p=2"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex cannot be compiled"),
    ({"structured_outputs": {"jsn": {}}}, "params.structured_outputs: unknown keys ['jsn']"),
    ({"n": 3}, "params.n=3: a row's n must equal the job's --n (1)"),
    ("[1, 2]", "'params' must be an object of SamplingParams fields"),
    ("{not json", "'params' is text that is not a JSON object"),
    ({"stop": [1]}, "SamplingParams.stop"),
]


def test_a_bad_value_fails_its_own_row_naming_the_field(runner):
    good = {"temperature": 0.0}
    rows = [{"text": "hello", "params": good}]
    for value, _ in BAD:
        rows += [{"text": "hello", "params": value}, {"text": "hello", "params": good}]
    columns = generate_shard(runner, rows, SOURCE, BASE, first_row=0)
    greedy = runner.generate([runner.tokenizer.encode("hello")], SamplingParams(temperature=0, max_tokens=10))
    for i, (value, message) in enumerate(BAD):
        assert message in (columns["error"][2 * i + 1] or ""), (value, columns["error"][2 * i + 1])
        assert columns["finish_reason"][2 * i + 1] == "error"
    for i in range(0, len(rows), 2):
        assert columns["error"][i] is None
        assert columns["generated_token_ids"][i] == greedy[0].token_ids[: len(columns["generated_token_ids"][i])]


def test_every_sampling_params_field_is_overridable_from_json():
    """Built from `dataclasses.fields`: each field's default, sent back through JSON, round-trips."""
    import dataclasses

    for f in dataclasses.fields(SamplingParams):
        value = getattr(SamplingParams(), f.name)
        if value is None or f.name == "n":
            continue
        decoded = json.loads(json.dumps(list(value) if isinstance(value, tuple) else value))
        assert getattr(override_sampling(BASE, {f.name: decoded}, "p"), f.name) == value, f.name


def test_the_row_seed_replaces_seed_plus_index_only_when_given():
    assert row_sampling(BASE, None, "p", 142).seed == 142
    assert row_sampling(BASE, {"seed": 3}, "p", 142).seed == 3
    assert row_sampling(BASE, '{"seed": null}', "p", 142).seed is None
