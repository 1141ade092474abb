"""Batch generation over a dataset with a hybrid model, sharded across Ray workers, written to Parquet.

    python jobs/generate.py --model MODEL --input DATA --prompt-column text --output out/
    ray job submit --working-dir . -- python jobs/generate.py --model MODEL --input DATA ...

Every flag can also come from a YAML file (--config job.yaml). Rerunning the same command resumes.
"""

from __future__ import annotations

import json
import sys

from pipeline.cli import parse_sections
from pipeline.config import (
    GenerateJobConfig,
    InputConfig,
    ModelConfig,
    OutputConfig,
    SamplingConfig,
    ScalingConfig,
    SpeculativeOptions,
)

SECTIONS = {"input": InputConfig, "model": ModelConfig, "sampling": SamplingConfig,
            "speculative": SpeculativeOptions, "scaling": ScalingConfig, "output": OutputConfig}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the job, print the summary; a bad flag or input exits with status 2 and a message."""
    try:
        config = GenerateJobConfig(**parse_sections(__doc__.splitlines()[0], SECTIONS, argv))
        from pipeline.driver import run
        from pipeline.generate import build_generate_job

        job = build_generate_job(config)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    totals = run(job)
    print(json.dumps({"output": config.output.output, **totals}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
