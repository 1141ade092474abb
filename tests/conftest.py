"""Session-wide tiny checkpoints (built once with transformers' save_pretrained) and their oracles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import FAMILIES, build_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """family name → path of its tiny checkpoint directory (built on first use)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """family path → transformers' own model loaded from it (the oracle), cached."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def get(path: Path) -> torch.nn.Module:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


ALL_FAMILIES = sorted(FAMILIES)
