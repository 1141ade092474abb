"""Runs `triton_cases.py` (the Triton kernels against the PyTorch reference) in a process with TRITON_INTERPRET=1.

Triton decides between its interpreter and its compiler at import, and other tests (or torch.compile) may import
it first in this process, so the cases get a fresh interpreter of their own.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.model.kernels import native
from workers.model.kernels.triton_kernels import interpreter_on
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.loader import prepare_decode_kernel

CASES = Path(__file__).with_name("triton_cases.py")
ROOT = Path(__file__).parents[3]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[test]')"
)
@pytest.mark.slow  # ~15 s: a fresh process, 19 interpreted cases
def test_triton_kernels_match_the_torch_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rs"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, f"{summary[0]}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]


@pytest.mark.skipif(interpreter_on(), reason="checks the choice without Triton's interpreter")
def test_auto_stays_native_on_cpu_and_triton_is_refused_there(checkpoint_dir):
    from workers.model import load_checkpoint

    for family in ("granite_dense", "qwen3_next"):
        model = load_checkpoint(str(checkpoint_dir(family)), decode_kernel="torch").model
        assert prepare_decode_kernel(model, "auto", torch.device("cpu"), torch.float32) == "native"
        with pytest.raises(ValueError, match="decode_kernel='triton' cannot run here: "):
            prepare_decode_kernel(model, "triton", torch.device("cpu"), torch.float32)
        mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer | GatedDeltaNetMixer)]
        assert mixers and {m.decode_kernel for m in mixers} <= {"native", "torch"}


def test_the_runner_logs_its_decode_path_once(checkpoint_dir, caplog):
    from workers.runner import ModelRunner

    with caplog.at_level(logging.INFO, logger="workers.runner"):
        ModelRunner.from_pretrained(str(checkpoint_dir("qwen3_5")), decode_kernel="torch")
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.runner"]
    kernels = f"; native CPU kernels: {native.describe()}" if native.loaded() else ""  # the native linears' variant
    assert lines == [
        "decode steps on cpu: recurrent decode kernel torch; decode plan off (the native kernels are off "
        "(not CPU float32, or decode_kernel / linear_backend chose another path)); "
        f"CUDA graphs off (turned off){kernels}"
    ]
