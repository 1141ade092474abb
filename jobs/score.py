"""Offline dataset scoring with a hybrid model: log-likelihood and perplexity per row, on the same Ray pipeline.

    python jobs/score.py --model MODEL --input DATA --text-column text --output scores/
    python jobs/score.py --model MODEL --input DATA --prompt-column question --completion-column answer ...

Every flag can also come from a YAML file (--config job.yaml). Rerunning the same command resumes.
"""

from __future__ import annotations

import sys

from pipeline.cli import run_job_cli
from pipeline.config import ModelConfig, OutputConfig, ScalingConfig
from pipeline.score_config import ScoreInputConfig, ScoreJobConfig, ScoreOptions

SECTIONS = {"input": ScoreInputConfig, "model": ModelConfig, "scoring": ScoreOptions, "scaling": ScalingConfig,
            "output": OutputConfig}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the scoring job the flags describe; returns the exit status."""
    from pipeline.score import build_score_job

    return run_job_cli(__doc__.splitlines()[0], SECTIONS, ScoreJobConfig, build_score_job, argv)


if __name__ == "__main__":
    sys.exit(main())
