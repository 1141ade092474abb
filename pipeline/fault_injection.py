"""The driver's crash-test hook (the workers' are in `workers/actor.py`, under the same environment variable)."""

from __future__ import annotations

import json
import os
import signal

from workers.actor import FAULT_INJECTION_ENV


def maybe_kill_driver(num_written: int) -> None:
    """Crash-test hook: {"kill_driver_after_shards": N} in HYBRIDGEN_FAULT_INJECTION kills this driver (SIGKILL)
    right after it has written N shard files."""
    plan = json.loads(os.environ.get(FAULT_INJECTION_ENV) or "{}")
    if plan.get("kill_driver_after_shards") == num_written:
        os.kill(os.getpid(), signal.SIGKILL)
