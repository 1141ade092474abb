"""Batch generation over a dataset with a hybrid model, sharded across Ray workers, written to Parquet.

    python jobs/generate.py --model MODEL --input DATA --prompt-column text --output out/
    ray job submit --working-dir . -- python jobs/generate.py --model MODEL --input DATA ...

Every flag can also come from a YAML file (--config job.yaml). Rerunning the same command resumes.
With no arguments at all it runs the embedded demo (examples/demo.yaml): a small trained hybrid model with a
hybrid draft model as speculative decoder, on ~200 code-completion prompts, writing output/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.cli import run_job_cli
from pipeline.config import (
    ChatConfig,
    GenerateJobConfig,
    InputConfig,
    ModelConfig,
    OutputConfig,
    SamplingConfig,
    ScalingConfig,
    SpeculativeOptions,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "examples" / "demo.yaml"

SECTIONS = {"input": InputConfig, "model": ModelConfig, "sampling": SamplingConfig, "chat": ChatConfig,
            "speculative": SpeculativeOptions, "scaling": ScalingConfig, "output": OutputConfig}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the job the flags describe (the embedded demo when there are none); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # the embedded demo; its paths are relative to the project root
        os.chdir(ROOT)
        argv = ["--config", str(DEMO_CONFIG)]
    from pipeline.generate import build_generate_job

    return run_job_cli(__doc__.splitlines()[0], SECTIONS, GenerateJobConfig, build_generate_job, argv)


if __name__ == "__main__":
    sys.exit(main())
