"""jobs/benchmark.py runs end to end on the tiny preset (the GPU script's code path, on CPU) and writes its JSON."""

from __future__ import annotations

import json

from jobs.benchmark import main


def test_benchmark_smoke_generate_and_score(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["generate"]] == [1, 2]
    assert all(
        row["output_tokens_per_s"] > 0 and row["transformers"]["output_tokens_per_s"] > 0 for row in result["generate"]
    )
    assert "generation (tokens/s)" in capsys.readouterr().out
    assert result["decode_kernel"] == "native"  # auto, on this CPU with a C compiler
    assert result["decode_plan"] == "on"
    assert main([*args, "--task", "score", "--json", str(out)]) == 0
    assert all(row["ratio_to_transformers"] > 0 for row in json.loads(out.read_text())["score"])


def test_benchmark_smoke_speculative(tmp_path):
    out = tmp_path / "spec.json"
    args = ["--preset", "tiny", "--batch-sizes", "2", "--new-tokens", "6", "--prompt-len", "16", "--repeats", "1",
            "--speculative", "draft", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    row = json.loads(out.read_text())["speculative"][0]
    assert row["identical_to_plain"] and row["acceptance_rate"] == 1.0  # the model drafting for itself


def test_benchmark_decode_kernel_flag_reaches_the_runner(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--batch-sizes", "1", "--new-tokens", "2", "--prompt-len", "4", "--repeats", "1",
            "--no-transformers", "--decode-kernel", "torch", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["decode_kernel"] == "torch"
    assert result["decode_plan"].startswith("off (the native kernels are off")
    assert main([*args[:-4], "--no-decode-plan", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["decode_plan"] == "off (--no-decode-plan)"


def test_benchmark_speculation_curve_measures_every_k_and_adaptive(tmp_path):
    out = tmp_path / "curve.json"
    args = ["--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "6", "--prompt-len", "16", "--repeats", "1",
            "--speculative", "ngram", "--num-speculative-tokens", "2", "--speculative-policy", "curve",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(out.read_text())["speculative"]
    assert [(r["batch"], r["policy"]) for r in rows] == [
        (b, p) for b in (1, 2) for p in ("fixed k=1", "fixed k=2", "adaptive k≤2")
    ]
    assert all(r["identical_to_plain"] for r in rows)
    chosen = [{pair.split(":")[0] for pair in r["steps_by_k"].split()} for r in rows[:2]]
    assert "1" in chosen[0] <= {"0", "1"} and "2" in chosen[1] <= {"0", "1", "2"}  # 0 or less: the token budget


def test_benchmark_gdn_preset_runs_both_engines(tmp_path, monkeypatch):
    """The GDN presets build a text-only Qwen3.5 checkpoint that both engines run in one go."""
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))  # a fresh preset, not a cached one
    out = tmp_path / "gdn.json"
    args = ["--preset", "gdn-tiny", "--batch-sizes", "1", "2", "--new-tokens", "4", "--prompt-len", "8",
            "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert json.loads((tmp_path / "hybridgen-gdn-tiny" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert [row["batch"] for row in result["generate"]] == [1, 2]
    assert all(row["ratio_to_transformers"] > 0 for row in result["generate"])
    assert result["decode_plan"].startswith("off (")  # GDN blocks run the module path
