"""jobs/acceptance.py measures MTP and draft-model acceptance on the shipped demo models, lossless, and writes JSON."""

from __future__ import annotations

import json

import pytest

from jobs.acceptance import main


def test_acceptance_report_on_a_few_prompts(tmp_path, capsys):
    out = tmp_path / "acceptance.json"
    assert main(["--num-prompts", "3", "--ks", "1", "2", "--max-tokens", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["k"]) for r in rows] == [("mtp", 1), ("mtp", 2), ("draft", 1), ("draft", 2)]
    for row in rows:
        positions = row["acceptance_per_position"]
        assert row["identical_to_plain"] and len(positions) == row["k"] and row["num_verification_steps"] > 0
        assert all(0 <= b <= a <= 1 for a, b in zip(positions, positions[1:]))  # draft j needs drafts 1 … j-1
        assert row["mean_accepted_length"] == pytest.approx(1 + sum(positions))  # accepted drafts per step
    assert "mean_len" in capsys.readouterr().out
