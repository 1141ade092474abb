"""Session-wide tiny checkpoints (built once with transformers' save_pretrained) and their oracles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.tiny_models import FAMILIES, build_checkpoint

torch.set_num_threads(2)


def other_family_builder(family: str) -> Callable[[str, Path], Path] | None:
    """The builder of a family kept out of `tiny_models.FAMILIES` (in its own fixture module), or None."""
    from tests.falcon_h1_models import FALCON_H1_FAMILIES, build_falcon_h1
    from tests.kimi_models import KIMI_FAMILIES, build_kimi_checkpoint
    from tests.lfm_models import LFM_FAMILIES, build_lfm_checkpoint
    from tests.tiny_jamba import JAMBA_FAMILIES, build_jamba_checkpoint
    from tests.workers.model.olmo_hybrid_fixtures import OLMO_HYBRID_FAMILIES, build_olmo_hybrid
    from tests.zamba2_models import ZAMBA2_LAYOUTS, build_zamba2

    tables = [
        (FALCON_H1_FAMILIES, build_falcon_h1),
        (KIMI_FAMILIES, build_kimi_checkpoint),
        (LFM_FAMILIES, build_lfm_checkpoint),
        (JAMBA_FAMILIES, build_jamba_checkpoint),
        (OLMO_HYBRID_FAMILIES, build_olmo_hybrid),
        (ZAMBA2_LAYOUTS, build_zamba2),
    ]
    return next((build for names, build in tables if family in names), None)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """family name (of `tiny_models`, or of a family's own fixture module: `other_family_builder`) → path of its tiny
    checkpoint directory (built on first use)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            build = other_family_builder(family) or build_checkpoint
            built[family] = build(family, tmp_path_factory.mktemp(family))
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
