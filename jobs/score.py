"""Offline dataset scoring with a hybrid model: log-likelihood and perplexity per row, on the same Ray pipeline.

    python jobs/score.py --model MODEL --input DATA --text-column text --output scores/
    python jobs/score.py --model MODEL --input DATA --prompt-column question --completion-column answer ...

Every flag can also come from a YAML file (--config job.yaml). Rerunning the same command resumes.
"""

from __future__ import annotations

import json
import sys

from pipeline.cli import parse_sections
from pipeline.config import ModelConfig, OutputConfig, ScalingConfig, ScoreInputConfig, ScoreJobConfig, ScoreOptions

SECTIONS = {"input": ScoreInputConfig, "model": ModelConfig, "scoring": ScoreOptions, "scaling": ScalingConfig,
            "output": OutputConfig}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the job, print the summary; a bad flag or input exits with status 2 and a message."""
    try:
        config = ScoreJobConfig(**parse_sections(__doc__.splitlines()[0], SECTIONS, argv))
        from pipeline.driver import run
        from pipeline.score import build_score_job

        job = build_score_job(config)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    totals = run(job)
    print(json.dumps({"output": config.output.output, **totals}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
