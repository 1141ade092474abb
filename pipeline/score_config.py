"""Typed configuration of the scoring job (`jobs/score.py`): its input and scoring sections; the model, scaling
and output sections are the generation job's (`pipeline/config.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import ModelConfig, OutputConfig, ScalingConfig
from pipeline.fields import doc, fail


@dataclass(frozen=True)
class ScoreInputConfig:
    """Where the rows come from and which columns to score."""

    input: str = doc(
        "hub dataset name, local Parquet/JSONL/CSV file, directory or glob, or a save_to_disk directory", default=""
    )
    split: str = doc("dataset split to read", default="train")
    text_column: str | None = doc("score every token of this text after the first", default=None)
    prompt_column: str | None = doc("with --completion-column: the conditioning prompt (not scored)", default=None)
    completion_column: str | None = doc("with --prompt-column: the text whose tokens are scored", default=None)
    messages_column: str | None = doc("chat messages; the last assistant turn is scored", default=None)
    id_column: str | None = doc(
        "column whose values become the output `id` (default: the input's `id` column if it "
        "has one, else the row index)",
        default=None,
    )

    def __post_init__(self) -> None:
        if not self.input:
            fail("ScoreInputConfig", "input", self.input, "give a dataset name, file, directory or glob")
        modes = [
            self.text_column is not None,
            self.messages_column is not None,
            self.prompt_column is not None or self.completion_column is not None,
        ]
        if sum(modes) != 1 or ((self.prompt_column is None) != (self.completion_column is None)):
            raise ValueError(
                "give exactly one of --text-column, --messages-column, or --prompt-column with --completion-column"
            )


@dataclass(frozen=True)
class ScoreOptions:
    """How rows are scored."""

    add_bos: bool | None = doc(
        "prepend the tokenizer's special tokens (default: the tokenizer's own choice)", default=None
    )
    truncate: bool = doc(
        "keep the first --max-model-len tokens of longer rows (else the row gets an error)", default=False
    )
    token_logprobs: bool = doc("also write each scored token's log-probability (list<float32>)", default=False)


@dataclass(frozen=True)
class ScoreJobConfig:
    """Everything `jobs/score.py` needs."""

    input: ScoreInputConfig
    model: ModelConfig
    scoring: ScoreOptions = field(default_factory=ScoreOptions)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict (for the manifest)."""
        return dataclasses.asdict(self)
