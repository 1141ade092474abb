"""Runs `triton_cases.py` (the Triton kernels against the PyTorch reference) in a process with TRITON_INTERPRET=1.

Triton decides between its interpreter and its compiler at import, and other tests (or torch.compile) may import
it first in this process, so the cases get a fresh interpreter of their own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.workers.model.interpreted import assert_cases_pass_in_the_interpreter, needs_triton
from workers.model.kernels import native
from workers.model.kernels.triton_kernels import interpreter_on
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.loader import prepare_decode_kernel

CASES = Path(__file__).with_name("triton_cases.py")


@needs_triton
@pytest.mark.slow  # ~60 s: a fresh process, 38 interpreted cases (4 of them whole models)
def test_triton_kernels_match_the_torch_reference_in_the_interpreter():
    assert_cases_pass_in_the_interpreter(CASES)


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
