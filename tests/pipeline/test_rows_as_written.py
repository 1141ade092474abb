"""Rows reach the model and the output as the user wrote them, through the CLI on a local Ray: tool-use chats in
every shape `datasets` stores them, a byte that is not UTF-8 (that row's error, not the job's), zero-padded ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from jobs.generate import main
from tests.pipeline.conftest import read_output
from workers import ModelRunner, SamplingParams

pytestmark = pytest.mark.slow

# Renders what tool-use templates render: a speaker's name, tool calls and their arguments, null content. `is
# defined` and `.items()` tell a missing key from a null one, as real templates do (`'tool_calls' in message`,
# `arguments | tojson`). The two calls' arguments have different keys: a struct column gives each call both.
TOOL_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }}{% if m.name is defined %} to {{ m.name }}{% endif %} :"
    "{% if m.content is not none %} {{ m.content }}{% endif %}"
    "{% if m.tool_calls is defined %}{% for call in m.tool_calls %} ran {{ call.function.name }}"
    "{% for key, value in call.function.arguments.items() %} {{ key }} {{ value }}{% endfor %}{% endfor %}{% endif %}"
    " <eos> {% endfor %}{% if add_generation_prompt %}<bos> assistant : {% endif %}"
)
CHATS = [
    [{"role": "user", "content": "the cat"}],
    [
        {"role": "user", "content": "a dog sat"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "mat", "arguments": {"place": "red"}}},
                        {"type": "function", "function": {"name": "dog", "arguments": {"to": "cat"}}}]},
        {"role": "tool", "name": "mat", "tool_call_id": "c1", "content": "big red"},
    ],
    [{"role": "system", "content": "hello"}, {"role": "user", "name": "dog", "content": "the cat ran"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def tool_model(checkpoint_dir, tmp_path_factory) -> Path:
    """The tiny granite checkpoint with a chat template that renders tool calls and names."""
    model = Path(shutil.copytree(checkpoint_dir("granite_moe"), tmp_path_factory.mktemp("tools") / "model"))
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return model


def _argv(model: Path, data: Path, output: Path, *flags: str) -> list[str]:
    paths = ["--model", str(model), "--input", str(data), "--output", str(output)]
    sampling = ["--max-model-len", "64", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"]
    return [*paths, *sampling, "--num-workers", "1", "--ray-address", "local", *flags]


def _jsonl(path: Path) -> None:  # datasets: list<extension<arrow.json>> (the messages' keys differ)
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))


def _parquet(path: Path) -> None:  # list<struct<…>>: every message gets every key, null where it had none
    pq.write_table(pa.table({"messages": pa.array(CHATS)}), path)


def _csv(path: Path) -> None:  # JSON text in a string column
    pacsv.write_csv(pa.table({"messages": [json.dumps(chat) for chat in CHATS]}), path)


@pytest.mark.parametrize("name,write", [("chats.jsonl", _jsonl), ("chats.parquet", _parquet), ("chats.csv", _csv)])
def test_tool_use_chats_render_as_apply_chat_template_does(name, write, tool_model, tmp_path, ray_session):
    data = tmp_path / name
    write(data)
    assert main(_argv(tool_model, data, tmp_path / "out", "--messages-column", "messages")) == 0
    rows = read_output(tmp_path / "out")
    runner = ModelRunner.from_pretrained(str(tool_model), max_model_len=64)
    template = runner.tokenizer.apply_chat_template
    expected = [template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) for chat in CHATS]
    direct = runner.generate(expected, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [row["error"] for row in rows] == [None] * len(CHATS)
    assert [row["num_prompt_tokens"] for row in rows] == [len(ids) for ids in expected]
    assert [row["generated_token_ids"] for row in rows] == [r.token_ids for r in direct]


def test_a_byte_that_is_not_utf8_fails_only_its_row(checkpoint_dir, tmp_path, ray_session):
    data = tmp_path / "prompts.jsonl"
    lines = [
        b'{"key": "a", "text": "the cat"}',
        b'{"key": "b", "text": "caf\xe9 au lait"}',
        b'{"key": "c", "text": "a dog"}',
    ]
    data.write_bytes(b"\n".join(lines) + b"\n")
    model = checkpoint_dir("granite_moe")
    argv = _argv(model, data, tmp_path / "out", "--prompt-column", "text", "--id-column", "key")
    assert main(argv) == 0
    rows = read_output(tmp_path / "out")  # every reader can read the file: the bad byte is U+FFFD there
    assert [row["id"] for row in rows] == ["a", "b", "c"]
    assert rows[1]["error"].startswith("'text' is not valid UTF-8 text (byte 0xe9 at position 3")
    assert rows[1]["text"] == "caf\ufffd au lait" and rows[1]["finish_reason"] == "error"
    assert rows[0]["error"] is None and rows[2]["error"] is None and rows[2]["num_generated_tokens"] == 5


def test_zero_padded_csv_ids_are_written_as_they_were_read(checkpoint_dir, tmp_path, ray_session):
    data = tmp_path / "prompts.csv"
    data.write_text("key,text\n007,the cat\n7,a dog\n0070,big red mat\n")
    flags = ["--prompt-column", "text", "--id-column", "key"]
    argv = _argv(checkpoint_dir("granite_moe"), data, tmp_path / "out", *flags)
    assert main(argv) == 0
    table = pq.read_table(tmp_path / "out")
    assert table.schema.field("id").type in (pa.string(), pa.large_string())
    assert sorted(table.column("id").to_pylist()) == ["007", "0070", "7"]
