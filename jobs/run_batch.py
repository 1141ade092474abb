"""OpenAI batch files through a hybrid model (vLLM's `run_batch`), on the sharded, resumable generation pipeline.

    python jobs/run_batch.py -i requests.jsonl -o results.jsonl --model MODEL
    python jobs/run_batch.py -i s3://bucket/in.jsonl -o s3://bucket/out.jsonl --model MODEL --num-workers 8

Each input line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}; each
output line answers one input line, in input order. The model, sampling (defaults a body overrides), chat,
speculative and scaling flags are the generate job's. Rerunning the same command resumes from the work directory.
"""

from __future__ import annotations

import sys

from pipeline.batch_job import BatchFileConfig
from pipeline.config import ChatConfig, ModelConfig, SamplingConfig, ScalingConfig, SpeculativeOptions

SECTIONS = {
    "batch": BatchFileConfig,
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "chat": ChatConfig,
    "speculative": SpeculativeOptions,
    "scaling": ScalingConfig,
}
SHORT_FLAGS = {"-i": "--input-file", "-o": "--output-file"}  # vLLM's run_batch spellings


def main(argv: list[str] | None = None) -> int:
    """Run the batch the flags describe; returns the exit status."""
    argv = [SHORT_FLAGS.get(arg, arg) for arg in (sys.argv[1:] if argv is None else argv)]
    from pipeline.batch_cli import run_batch_cli

    return run_batch_cli(__doc__.splitlines()[0], SECTIONS, argv)


if __name__ == "__main__":
    sys.exit(main())
