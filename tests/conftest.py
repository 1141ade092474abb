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
    import transformers

    cache: dict[Path, torch.nn.Module] = {}

    def get(path: Path) -> torch.nn.Module:
        if path not in cache:
            # The class the checkpoint was saved from: for a vision-language wrapper (Qwen3.5) that is the
            # ForConditionalGeneration model, whose LM head follows the wrapper's tying.
            architecture = transformers.AutoConfig.from_pretrained(path).architectures[0]
            model_class = getattr(transformers, architecture)
            cache[path] = model_class.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


ALL_FAMILIES = sorted(FAMILIES)
