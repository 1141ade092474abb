"""The model directory's tokenizer, and the check that a draft model shares the target's vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(directory: Path) -> Any | None:
    """The model directory's tokenizer (no remote code), or None when it ships none."""
    if not any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)


def check_same_tokenizer(target: Any | None, draft: Any | None, draft_path: str) -> None:
    """`ValueError` unless the draft model's tokenizer has the target's vocabulary."""
    if (target is None) != (draft is None) or (target is not None and target.get_vocab() != draft.get_vocab()):
        raise ValueError(f"draft model {draft_path!r} has a different tokenizer vocabulary than the target")
