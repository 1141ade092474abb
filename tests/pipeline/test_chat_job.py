"""The chat flags on the job side: in the resume fingerprint (the template's content, not its path), checked before
any worker starts, and one job on a local Ray rendering with them and writing reasoning_text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cli import parse_sections
from pipeline.config import ChatConfig
from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.manifest import prepare_output
from pipeline.output import OutputDir
from tests.pipeline.conftest import job_config, read_output, write_dataset
from workers import ModelRunner, SamplingParams

TEMPLATE = (
    "{% for m in messages %}{{ m.content }} mat {% endfor %}"
    "{% if add_generation_prompt %}hello{% if enable_thinking is defined and not enable_thinking %} world"
    "{% endif %}{% endif %}"
)


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


def test_template_kwargs_and_template_content_are_in_the_fingerprint(model, tmp_path):
    data, out, template = write_dataset(tmp_path / "prompts.jsonl"), tmp_path / "out", tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)

    def prepare(overwrite: bool = False, **overrides):
        config = job_config(model, data, out, chat_template=str(template), **overrides)
        return prepare_output(OutputDir(str(out)), build_generate_job(config), overwrite)

    prepare(chat_template_kwargs={"enable_thinking": False})
    assert prepare(chat_template_kwargs={"enable_thinking": False}).done == set()  # unchanged: resumes
    with pytest.raises(ValueError, match=r"different job \(.*chat.chat_template_kwargs"):
        prepare(chat_template_kwargs={"enable_thinking": True})
    with pytest.raises(ValueError, match=r"different job \(.*chat.reasoning_parser"):
        prepare(chat_template_kwargs={"enable_thinking": False}, reasoning_parser="qwen3")
    # The same path with another template in it is another job; its old content again resumes.
    template.write_text(TEMPLATE.replace("mat", "and"))
    with pytest.raises(ValueError, match=r"different job \(.*chat.chat_template"):
        prepare(chat_template_kwargs={"enable_thinking": False})
    template.write_text(TEMPLATE)
    moved = tmp_path / "moved.jinja"
    shutil.copy(template, moved)
    config = job_config(model, data, out, chat_template=str(moved), chat_template_kwargs={"enable_thinking": False})
    assert prepare_output(OutputDir(str(out)), build_generate_job(config), False).done == set()


def test_bad_chat_flags_fail_before_any_worker(model, tmp_path):
    data = write_dataset(tmp_path / "prompts.jsonl")
    with pytest.raises(ValueError, match="--chat-template .*no such file"):
        build_generate_job(job_config(model, data, tmp_path / "o", chat_template=str(tmp_path / "missing.jinja")))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="--chat-template .*not a valid Jinja template"):
        build_generate_job(job_config(model, data, tmp_path / "o", chat_template=str(broken)))
    with pytest.raises(ValueError, match="--reasoning-parser .* must be one of deepseek_r1, qwen3, granite, nemotron"):
        parse_sections("t", {"chat": ChatConfig}, ["--reasoning-parser", "r1"])
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message cannot both be on"):
        parse_sections("t", {"chat": ChatConfig}, ["--continue-final-message"])


@pytest.mark.slow
def test_a_chat_job_renders_with_the_flags_and_writes_reasoning_text(model, tmp_path, ray_session):
    """`</think>` replaces a word the model generates, so some rows close their thought and others are cut by
    max_tokens mid-thought; each row's split is checked against the runner's text for the prompt the template
    gives with enable_thinking false."""
    runner = ModelRunner.from_pretrained(str(model))
    contents = ["the cat", "a dog sat", "big red mat", "hello world", "the mat", "to the dog"]
    rendered = [runner.tokenizer.encode(f"{c} mat hello world") for c in contents]
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = [r.token_ids for r in runner.generate(rendered, sampling)]
    # The token generated third in the first row becomes "</think>" (the tokenizer file edited in a copy).
    end_id = plain[0][2]
    word = runner.tokenizer.convert_ids_to_tokens(end_id)
    thinking = tmp_path / "model"
    shutil.copytree(model, thinking)
    vocab = json.loads((thinking / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {("</think>" if t == word else t): i for t, i in vocab["model"]["vocab"].items()}
    (thinking / "tokenizer.json").write_text(json.dumps(vocab))
    data, template = tmp_path / "chat.jsonl", tmp_path / "chat.jinja"
    data.write_text("".join(json.dumps({"m": [{"role": "user", "content": c}]}) + "\n" for c in contents))
    template.write_text(TEMPLATE)
    overrides = dict(prompt_column=None, messages_column="m", id_column=None, max_model_len=64)
    chat = dict(chat_template=str(template), chat_template_kwargs={"enable_thinking": False})
    config = job_config(thinking, data, tmp_path / "out", **overrides, **chat, reasoning_parser="deepseek_r1")
    run(build_generate_job(config))
    out = read_output(tmp_path / "out")
    closed = 0
    for row, prompt, ids in zip(out, rendered, plain):
        assert row["num_prompt_tokens"] == len(prompt) and row["generated_token_ids"] == ids
        if end_id in ids:  # the words before the first </think> token, and after it
            closed += 1
            k = ids.index(end_id)
            assert row["reasoning_text"].split() == runner.tokenizer.decode(ids[:k], skip_special_tokens=True).split()
            assert (row["generated_text"] or "").split() == runner.tokenizer.decode(
                ids[k + 1 :], skip_special_tokens=True
            ).split()
        else:  # cut by max_tokens mid-thought: all reasoning
            assert row["reasoning_text"].split() == runner.tokenizer.decode(ids, skip_special_tokens=True).split()
            assert row["generated_text"] is None
    assert 1 <= closed < len(contents)
