"""Per-row parameters through a job, and `jobs/run_batch.py` (OpenAI batch files) on a local Ray: each row equals
the row run alone on a runner with its parameters written out by hand; the batch output has OpenAI's batch output
shape, one line per input line in input order; a driver killed mid-job and rerun writes the same file."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from jobs.run_batch import main as run_batch_main
from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.output import OutputRefused
from tests.pipeline.conftest import job_config, read_output
from tests.pipeline.test_object_storage import BUCKET, s3  # noqa: F401 (the moto S3 server fixture)
from workers import ModelRunner, SamplingParams

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("granite_moe")


@pytest.fixture(scope="module")
def runner(model) -> ModelRunner:
    return ModelRunner.from_pretrained(str(model))


def test_rows_with_their_own_parameters_equal_each_row_run_alone(model, runner, tmp_path, ray_session):
    base = dict(max_tokens=6, ignore_eos=True)  # the job's flags below, minus temperature and seed
    rows = [  # (params column, the SamplingParams the row must behave as: seed 11 + row unless its own)
        (None, SamplingParams(temperature=0.8, seed=11, **base)),
        (
            {"temperature": 0.0, "max_tokens": 3},
            SamplingParams(temperature=0.0, seed=12, max_tokens=3, ignore_eos=True),
        ),
        ({"seed": 99, "top_k": 4}, SamplingParams(temperature=0.8, seed=99, top_k=4, **base)),
        ({"temperature": -1.0}, None),  # bad: that row's error names the field
        ({"stop": ["cat"], "logprobs": 2}, SamplingParams(temperature=0.8, seed=15, stop=("cat",), logprobs=2, **base)),
        (
            {"temperature": 1.3, "max_tokens": 8},
            SamplingParams(temperature=1.3, seed=16, max_tokens=8, ignore_eos=True),
        ),
    ]
    texts = ["the cat sat", "hello world", "a big dog", "red mat", "the dog", "cat on a mat"]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": t, "params": p, "same": p}) + "\n" for t, (p, _) in zip(texts, rows)))
    config = job_config(
        model,
        data,
        tmp_path / "out",
        id_column=None,
        sampling_params_column="params",
        temperature=0.8,
        seed=11,
        rows_per_shard=2,
        num_workers=1,
    )
    run(build_generate_job(config))
    out = read_output(tmp_path / "out")
    # The column's name is in the resume fingerprint (its values are input data): another name is another job.
    other = dataclasses.replace(config, input=dataclasses.replace(config.input, sampling_params_column="same"))
    with pytest.raises(OutputRefused, match="input.sampling_params_column"):
        run(build_generate_job(other))
    for i, (text, (_, params)) in enumerate(zip(texts, rows)):
        if params is None:
            assert "SamplingParams.temperature=-1.0 is invalid" in out[i]["error"]
            continue
        alone = runner.generate([runner.tokenizer.encode(text)], params)[0]
        assert out[i]["error"] is None
        assert out[i]["generated_token_ids"] == alone.token_ids, i
        if params.logprobs is not None:
            assert out[i]["logprobs"] == pytest.approx([e[t] for t, e in zip(alone.token_ids, alone.logprobs)])
        else:
            assert out[i]["logprobs"] is None


LINES = [
    {
        "custom_id": "chat-n2",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "messages": [{"role": "user", "content": "the cat sat"}],
            "n": 2,
            "temperature": 0.7,
            "seed": 3,
            "max_tokens": 5,
        },
    },
    {
        "custom_id": "text-lp",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hello world", "max_tokens": 4, "temperature": 0, "logprobs": 2},
    },
    "{not json",
    {
        "custom_id": "chat-bad",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "a dog"}], "temperature": -1},
    },
    {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    {
        "custom_id": "chat-lp",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "red mat"}],
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
            "max_completion_tokens": 3,
        },
    },
    {
        "custom_id": "text-seeded",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "the dog", "max_tokens": 6},
    },
]
# What each runnable line must equal, run alone (the job's --seed 5: row 4, the 5th line that runs, draws 5 + 4).
ALONE = {
    "chat-n2": SamplingParams(temperature=0.7, seed=3, max_tokens=5, n=2, ignore_eos=True),
    "text-lp": SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True),
    "chat-lp": SamplingParams(temperature=0, max_tokens=3, logprobs=1, ignore_eos=True),
    "text-seeded": SamplingParams(temperature=1.0, seed=5 + 4, max_tokens=6, ignore_eos=True),
}


def batch_argv(model: Path, tmp_path: Path, output: Path) -> list[str]:
    data = tmp_path / "batch.jsonl"
    data.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in LINES))
    return [
        "-i",
        str(data),
        "-o",
        str(output),
        "--model",
        str(model),
        "--max-model-len",
        "64",
        "--seed",
        "5",
        "--ignore-eos",
        "--num-workers",
        "1",
        "--rows-per-shard",
        "1",
        "--ray-address",
        "local",
    ]


def check_batch_output_shape(line: dict) -> None:
    """OpenAI's batch output line (and vLLM's error form): the keys and their types."""
    assert set(line) == {"id", "custom_id", "response", "error"} and isinstance(line["id"], str)
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and isinstance(response["request_id"], str)
    if line["error"] is not None:
        assert response["status_code"] == 400 and response["body"] is None
        assert set(line["error"]) == {"code", "message"} and all(isinstance(v, str) for v in line["error"].values())
        return
    body = response["body"]
    assert response["status_code"] == 200
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert isinstance(body["created"], int) and isinstance(body["id"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for j, choice in enumerate(body["choices"]):
        assert choice["index"] == j and choice["finish_reason"] in ("stop", "length")
        if body["object"] == "chat.completion":
            assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert body["object"] == "text_completion" and isinstance(choice["text"], str)
            assert set(choice) == {"index", "text", "logprobs", "finish_reason"}


@pytest.fixture(scope="module")
def batch_output(model, tmp_path_factory, ray_session) -> tuple[list[str], Path]:
    tmp_path = tmp_path_factory.mktemp("batch")
    argv = batch_argv(model, tmp_path, tmp_path / "out.jsonl")
    assert run_batch_main(argv) == 0
    return argv, tmp_path / "out.jsonl"


def test_batch_file_lines_answer_each_input_line_in_order(batch_output, runner):
    lines = [json.loads(text) for text in batch_output[1].read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [
        "chat-n2",
        "text-lp",
        None,
        "chat-bad",
        "embed",
        "chat-lp",
        "text-seeded",
    ]
    for line in lines:
        check_batch_output_shape(line)
    by_id = {line["custom_id"]: line for line in lines}
    assert "not JSON" in lines[2]["error"]["message"]
    assert "temperature" in by_id["chat-bad"]["error"]["message"]
    assert "/v1/embeddings" in by_id["embed"]["error"]["message"]
    for custom_id, params in ALONE.items():
        line = next(line for line in LINES if isinstance(line, dict) and line["custom_id"] == custom_id)
        body = line["body"]
        if "messages" in body:
            prompt = runner.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            prompt = runner.tokenizer.encode(body["prompt"])
        alone = runner.generate([list(prompt)], params)
        answer = by_id[custom_id]["response"]["body"]
        assert len(answer["choices"]) == params.n
        for choice, result in zip(answer["choices"], alone):
            text = choice["message"]["content"] if answer["object"] == "chat.completion" else choice["text"]
            assert text == result.text, custom_id
        assert answer["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in alone)
        assert answer["usage"]["prompt_tokens"] == len(prompt)
    chat_logprobs = by_id["chat-lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(chat_logprobs) == 3 and all(len(entry["top_logprobs"]) == 1 for entry in chat_logprobs)
    text_logprobs = by_id["text-lp"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(text_logprobs["tokens"]) == 4 and all(len(top) <= 2 for top in text_logprobs["top_logprobs"])


def test_a_killed_batch_job_resumes_to_the_same_file(batch_output, model, tmp_path):
    output = tmp_path / "out.jsonl"
    command = [sys.executable, "jobs/run_batch.py", *batch_argv(model, tmp_path, output)]
    env = {**os.environ, "HYBRIDGEN_FAULT_INJECTION": json.dumps({"kill_driver_after_shards": 2})}
    driver = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    assert driver.wait(timeout=300) == -signal.SIGKILL
    try:
        os.killpg(driver.pid, signal.SIGKILL)  # whatever of its local Ray is left
    except ProcessLookupError:
        pass
    shards = Path(f"{output}.parts") / "shards"
    finished = {p.name: p.stat().st_mtime_ns for p in shards.glob("part-*.parquet")}
    assert len(finished) == 2 and not output.exists()
    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    after = {p.name: p.stat().st_mtime_ns for p in shards.glob("part-*.parquet")}
    assert {name: after[name] for name in finished} == finished and len(after) == 5  # the 5 lines that run
    reference = [_split_floats(json.loads(line)) for line in batch_output[1].read_text().splitlines()]
    resumed = [_split_floats(json.loads(line)) for line in output.read_text().splitlines()]
    # The same answers; logprobs within float32 noise (rows batched otherwise sum in another order), `created` is
    # this work directory's first start.
    assert [line for line, _ in resumed] == [line for line, _ in reference]
    assert [floats for _, floats in resumed] == [pytest.approx(floats, abs=1e-4) for _, floats in reference]
    manifest = json.loads((shards / "_manifest.json").read_text())
    assert [run["shards_already_done"] for run in manifest["runs"]] == [0, 2]
    started = datetime.strptime(manifest["started_at"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    created = {
        json.loads(line)["response"]["body"]["created"]
        for line in output.read_text().splitlines()
        if json.loads(line)["error"] is None
    }
    assert created == {int(started)}  # the killed run's start: a rerun writes the same file


def _split_floats(value):
    """(the value with `created` and every float replaced by None, the floats in order)."""
    floats = []

    def walk(item, key=None):
        if isinstance(item, dict):
            return {k: walk(v, k) for k, v in item.items()}
        if isinstance(item, list):
            return [walk(v) for v in item]
        if isinstance(item, float):
            floats.append(item)
            return None
        return None if key == "created" else item

    return walk(value), floats


def test_batch_files_and_work_directory_on_s3(batch_output, s3, model, tmp_path):  # noqa: F811 (fixture)
    # Keys of its own: moto's state outlives a module's server, and test_object_storage reads everything under in/.
    data = Path(batch_output[0][1])
    s3.put_object(Bucket=BUCKET, Key="run-batch/in/batch.jsonl", Body=data.read_bytes())
    argv = list(batch_output[0])
    argv[1], argv[3] = f"s3://{BUCKET}/run-batch/in/batch.jsonl", f"s3://{BUCKET}/run-batch/out/results.jsonl"
    assert run_batch_main(argv) == 0
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="run-batch/out/")["Contents"]}
    parts = "run-batch/out/results.jsonl.parts"
    assert f"{parts}/requests.parquet" in keys and f"{parts}/shards/_SUCCESS" in keys
    text = s3.get_object(Bucket=BUCKET, Key="run-batch/out/results.jsonl")["Body"].read().decode()
    written = [_split_floats(json.loads(line)) for line in text.splitlines()]
    reference = [_split_floats(json.loads(line)) for line in batch_output[1].read_text().splitlines()]
    assert [line for line, _ in written] == [line for line, _ in reference]
    assert [floats for _, floats in written] == [pytest.approx(floats, abs=1e-4) for _, floats in reference]
