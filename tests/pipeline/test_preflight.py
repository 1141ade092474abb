"""A bad model is refused on the driver, in seconds, with one line and exit status 2, before any output exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import pipeline.driver
from jobs.generate import main
from jobs.score import main as score_main
from pipeline.preflight import check_model


@pytest.fixture
def model_copy(checkpoint_dir, tmp_path) -> Path:
    """A private copy of a tiny checkpoint that a test may break."""
    return Path(shutil.copytree(checkpoint_dir("bamba"), tmp_path / "model"))


@pytest.fixture
def no_driver(monkeypatch):
    """Reaching the driver (Ray, workers) would mean the bad model got through: fail instead of hanging."""

    def refuse(job):
        raise AssertionError("the job reached the driver")

    monkeypatch.setattr(pipeline.driver, "run", refuse)


def _generate(model: Path | str, tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat"}\n')
    return [
        "--model",
        str(model),
        "--input",
        str(data),
        "--prompt-column",
        "text",
        "--output",
        str(tmp_path / "out"),
        *extra,
    ]


def _refused(argv: list[str], capsys, tmp_path: Path, entry=main) -> str:
    capsys.readouterr()  # what fixtures printed (building checkpoints)
    assert entry(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written
    return err


def test_truncated_weights_are_refused(model_copy, tmp_path, capsys, no_driver):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # an interrupted download
    err = _refused(_generate(model_copy, tmp_path), capsys, tmp_path)
    assert f"model '{model_copy}'" in err and "model.safetensors is truncated" in err


def test_header_cut_short_is_refused(model_copy, tmp_path, capsys, no_driver):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    err = _refused(_generate(model_copy, tmp_path), capsys, tmp_path)
    assert "does not fit in the file's 100 bytes" in err


def test_unsupported_model_type_is_refused(model_copy, tmp_path, capsys, no_driver):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    err = _refused(_generate(model_copy, tmp_path), capsys, tmp_path)
    assert "unsupported model_type 'gpt2'" in err and "supported: granitemoehybrid, bamba, nemotron_h" in err


def test_missing_model_directory_is_one_line(tmp_path, capsys, no_driver):
    err = _refused(_generate("/path/that/does/not/exist", tmp_path), capsys, tmp_path)
    assert "model '/path/that/does/not/exist': does not exist" in err


def test_wrong_tensor_names_are_refused(model_copy, tmp_path, capsys, no_driver):
    tensors = load_file(model_copy / "model.safetensors")
    key = next(k for k in tensors if k.endswith("mamba.A_log"))
    tensors[key.replace("A_log", "A_logarithm")] = tensors.pop(key)
    save_file(tensors, model_copy / "model.safetensors")
    err = _refused(_generate(model_copy, tmp_path), capsys, tmp_path, entry=main)
    assert f"missing weight ['{key}']" in err and "unexpected weight" in err


def test_sharded_checkpoint_with_a_missing_file_is_refused(model_copy, tmp_path, capsys, no_driver):
    tensors = load_file(model_copy / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, model_copy / file)
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model_copy / "model.safetensors").unlink()
    check_model(str(model_copy))  # the complete sharded checkpoint passes
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    (tmp_path / "d.jsonl").write_text('{"text": "the cat"}\n')
    err = _refused(
        [
            "--model",
            str(model_copy),
            "--input",
            str(tmp_path / "d.jsonl"),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "out"),
        ],
        capsys,
        tmp_path,
        entry=score_main,
    )
    assert "1 of the 2 weight files named in model.safetensors.index.json are missing" in err


def test_bad_draft_model_is_named(checkpoint_dir, model_copy, tmp_path, capsys, no_driver):
    (model_copy / "config.json").write_text("{not json")
    argv = _generate(
        checkpoint_dir("granite_moe"), tmp_path, "--speculative", "draft", "--draft-model", str(model_copy)
    )
    err = _refused(argv, capsys, tmp_path)
    assert f"draft model '{model_copy}': config.json does not parse" in err


def test_good_models_pass(checkpoint_dir):
    for family in ("bamba", "granite_moe", "nemotron_moe"):
        check_model(str(checkpoint_dir(family)))


def test_mtp_without_an_mtp_head_is_refused_before_any_work(checkpoint_dir, tmp_path, capsys, no_driver):
    err = _refused(_generate(checkpoint_dir("bamba"), tmp_path, "--speculative", "mtp"), capsys, tmp_path)
    assert "speculative method 'mtp' is supported for nemotron_h, qwen3_next" in err and "not 'bamba'" in err
    qwen = Path(shutil.copytree(checkpoint_dir("qwen3_5"), tmp_path / "qwen"))
    tensors = {k: v for k, v in load_file(qwen / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(tensors, qwen / "model.safetensors", metadata={"format": "pt"})
    err = _refused(_generate(qwen, tmp_path, "--speculative", "mtp"), capsys, tmp_path)
    assert "has no mtp.* weights" in err
    check_model(str(checkpoint_dir("qwen3_5")), need_mtp=True)  # the untouched checkpoint carries its head
