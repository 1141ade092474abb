"""Running a file of Triton test cases under Triton's interpreter: Triton decides between its interpreter and its
compiler at import, so the cases run in a fresh process with TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[test]')"
)


def assert_cases_pass_in_the_interpreter(cases: Path) -> None:
    """Run pytest over `cases` in a fresh interpreted process; every case must pass (none skipped)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", str(cases), "-q", "-p", "no:cacheprovider", "-rs"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, f"{summary[0]}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]
