"""jobs/benchmark.py --task structured runs end to end on a tiny checkpoint that can spell JSON."""

from __future__ import annotations

import json

from jobs.benchmark import main
from tests.workers.structured_fixtures import ascii_checkpoint


def test_benchmark_structured_task(tmp_path, capsys):
    model = str(ascii_checkpoint("granite_dense", tmp_path / "model"))
    out = tmp_path / "structured.json"
    sizes = ["--batch-sizes", "2", "--new-tokens", "8", "--repeats", "1"]
    assert main(["--task", "structured", "--model", model, "--draft-model", model, *sizes, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["structured"]
    assert [row["decoding"] for row in rows] == ["plain", "ngram", "draft"]
    assert all(row["json_schema_tokens_per_s"] > 0 and row["ratio"] > 0 for row in rows)
    assert "JSON schema vs unconstrained" in capsys.readouterr().out
