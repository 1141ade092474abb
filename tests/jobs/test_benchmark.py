"""jobs/benchmark.py runs end to end on the tiny preset (the GPU script's code path, on CPU) and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.benchmark import main
from workers.model.kernels import native

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_benchmark_smoke_generate_and_score(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["generate"]] == [1, 2]
    assert all(
        row["output_tokens_per_s"] > 0 and row["transformers"]["output_tokens_per_s"] > 0 for row in result["generate"]
    )
    printed = capsys.readouterr().out
    assert "generation (tokens/s)" in printed
    assert result["decode_kernel"] == "native"  # auto, on this CPU with a C compiler
    assert result["cpu_kernels"].startswith(f"{native.selected_isa()} kernels (")  # the instruction set used
    assert f"CPU kernels: {result['cpu_kernels']}" in printed
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
            "--speculative", "draft", "--num-speculative-tokens", "2", "--speculative-policy", "curve",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(out.read_text())["speculative"]
    assert [(r["batch"], r["policy"]) for r in rows] == [
        (b, p) for b in (1, 2) for p in ("fixed k=1", "fixed k=2", "adaptive k≤2")
    ]
    assert all(r["identical_to_plain"] for r in rows)
    chosen = [{pair.split(":")[0] for pair in r["steps_by_k"].split()} for r in rows[:2]]
    assert "1" in chosen[0] <= {"0", "1"} and "2" in chosen[1] <= {"0", "1", "2"}  # 0 or less: the token budget


def test_benchmark_speculation_on_demo_prompts_of_one_kind(tmp_path):
    """`--prompts` filtered by `--prompt-kind`, at least `--min-prompts` of them per batch size, run batch-size at
    a time (batch 1 over several prompts), plain and speculative taking turns."""
    out = tmp_path / "kind.json"
    args = ["--model", str(EXAMPLES / "models/demo-target"), "--prompts", str(EXAMPLES / "prompts.jsonl"),
            "--prompt-kind", "copy",
            "--min-prompts", "3", "--batch-sizes", "1", "2", "--new-tokens", "4", "--repeats", "1",
            "--speculative", "ngram", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(out.read_text())["speculative"]
    assert [(r["batch"], r["prompts"]) for r in rows] == [(1, 3), (2, 3)]
    assert all(r["identical_to_plain"] and r["spec_tokens_per_s"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="prompts of kind 'copy', 80 needed"):
        main([*args[:-2], "--min-prompts", "80", "--json", str(out)])


def test_benchmark_graphs_vs_eager_roofline_and_peak_memory(tmp_path, capsys):
    """The GPU command's code path on CPU (graphs in their eager form): both engines in one run, the batch-1
    roofline share from the bytes a step reads (weights counted as transformers counts the checkpoint's), and
    peak memory."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "graphs.json"
    args = ["--preset", "tiny", "--batch-sizes", "1", "2", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1",
            "--no-transformers", "--cuda-graphs", "on", "--peak-bandwidth-gbs", "20", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["cuda_graphs"] == "eager form (no CUDA)"
    for row in result["generate"]:
        assert row["engine"] == "hybridgen (graphs)" and row["eager"]["engine"] == "hybridgen (eager)"
        assert row["output_tokens_per_s"] > 0 and row["eager"]["output_tokens_per_s"] > 0
        assert row["peak_memory_mb"] > 0 and row["eager"]["peak_memory_mb"] > 0
        assert row["graphs_speedup"] == row["output_tokens_per_s"] / row["eager"]["output_tokens_per_s"]
    roofline = result["roofline_batch1"]
    hf = AutoModelForCausalLM.from_pretrained(result["model"])
    embedding_row = hf.config.hidden_size * 4  # the tiny preset ties its LM head to the float32 embedding table
    weights = sum(p.numel() * p.element_size() for p in hf.parameters()) + embedding_row
    assert roofline["bytes_per_step"]["weights"] == weights
    total, batch1 = sum(roofline["bytes_per_step"].values()), result["generate"][0]
    assert roofline["share"]["hybridgen (graphs)"] == total * batch1["decode_tokens_per_s"] / 20e9
    assert roofline["share"]["hybridgen (eager)"] == total * batch1["eager"]["decode_tokens_per_s"] / 20e9
    printed = capsys.readouterr().out
    assert "batch-1 roofline" in printed and "eager_output_tokens_per_s" in printed
    assert "CUDA graphs: eager form (no CUDA)" in printed


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
    assert result["decode_plan"] == "on"  # GDN and gated attention blocks run as one native call


def test_benchmark_resume_bookkeeping_without_a_model(tmp_path, capsys):
    """`--task resume` plans, prepares, resumes and finalizes synthetic jobs of each size; no model is built."""
    out = tmp_path / "resume.json"
    assert main(["--task", "resume", "--num-shards", "10", "30", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["resume"]
    assert [row["num_shards"] for row in rows] == [10, 30]
    steps = ("plan_ms", "prepare_ms", "write_ms", "finalize_own_ms", "resume_ms", "finalize_resumed_ms")
    assert all(row[step] > 0 for row in rows for step in steps)
    assert "shard bookkeeping (milliseconds)" in capsys.readouterr().out


FAMILY_PRESET_TYPES = {
    "jamba-bench": "jamba",
    "zamba2-bench": "zamba2",
    "kimi-bench": "kimi_linear",
    "olmo-bench": "olmo_hybrid",
    "lfm3-bench": "lfm3",
}


@pytest.mark.parametrize(("preset", "model_type"), FAMILY_PRESET_TYPES.items())
def test_family_presets_are_their_familys_configs_at_the_bench_size(preset, model_type):
    """Each family preset is a transformers config of that family, 512 wide and 8 layers deep, that hybridgen reads
    (building the full model is left to the benchmark itself: too slow for the suite)."""
    import transformers

    from bench.family_presets import FAMILY_PRESETS
    from workers.model.checkpoint.config import HybridConfig

    config_class, model_class, shape = FAMILY_PRESETS[preset]
    config = getattr(transformers, config_class)(**shape)
    assert config.model_type == model_type and hasattr(transformers, model_class)
    ours = HybridConfig.from_hf_dict(config.to_dict())
    assert (ours.hidden_size, len(ours.block_kinds) >= 8, ours.vocab_size) == (512, True, 32000)


def test_benchmark_prefill_task_times_long_prompts_against_transformers(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    args = ["--preset", "tiny", "--task", "prefill", "--batch-sizes", "2", "--prompt-len", "48", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["prefill"]
    assert row["batch"] == 2 and row["prefill_tokens_per_s"] > 0 and row["ratio_to_transformers"] > 0
    assert "prefill: 48-token prompts, 1 new token" in capsys.readouterr().out


def test_benchmark_n_samples_computes_each_prompt_once(tmp_path):
    out = tmp_path / "n.json"
    args = "--preset tiny --task n --n 3 --batch-sizes 2 --new-tokens 4 --prompt-len 40 --repeats 1".split()
    args += ["--json", str(out)]
    assert main(args) == 0
    rows = {row["mode"]: row for row in json.loads(out.read_text())["n"]}
    assert rows["n=3"]["prompt_tokens_computed"] == 2 * 40  # each prompt once, its samples forked
    assert rows["3 duplicated rows, cache off"]["prompt_tokens_computed"] == 3 * 2 * 40
    assert all(row["identical_to_n"] and row["generated_tokens"] == 3 * 2 * 4 for row in rows.values())
