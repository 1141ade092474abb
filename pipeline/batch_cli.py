"""The life of a `jobs/run_batch.py` command: flags → parsed batch file → generate job → output JSONL.

Exit statuses as `pipeline/cli.py`'s `run_job_cli`: 2 for a bad flag, input file, model or work directory (before
any worker starts), 1 for a job that cannot finish. Bad lines never fail the command: they are error lines.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.cli import parse_sections


def run_batch_cli(description: str, sections: dict[str, type], argv: list[str]) -> int:
    """Parse the flags, run (or resume) the batch's job and write its output; prints a JSON summary."""
    from pipeline.batch_job import prepare_batch, write_output
    from pipeline.fit import ModelDoesNotFit
    from pipeline.output import OutputRefused

    try:
        values: dict[str, Any] = parse_sections(description, sections, argv)
        batch = values.pop("batch")
        plan = prepare_batch(batch, values)
    except (ValueError, FileNotFoundError) as error:
        return _fail(error, 2)
    from pipeline.driver import JobFailed, run

    totals: dict[str, Any] = {}
    try:
        if plan.job is not None:
            totals = run(plan.job)
    except (OutputRefused, ModelDoesNotFit) as error:
        return _fail(error, 2)
    except JobFailed as error:
        return _fail(error, 1)
    counts = write_output(plan)
    print(json.dumps({"output_file": batch.output_file, "work_dir": batch.work_dir, **counts, **totals}, indent=2))
    return 0


def _fail(error: Exception, status: int) -> int:
    """Print `error: …` on one line; return `status`."""
    import sys

    print("error: " + " ".join(str(error).split()), file=sys.stderr)
    return status
