"""Fused Triton kernels for recurrent decode steps on CUDA (optional: the pure-PyTorch path is the reference).

One decode step of a recurrent layer becomes three launches — the causal conv step (window shifted in place), the
recurrence (Mamba2's SSM update + D skip + gate, or the gated delta rule, state updated in place in float32), the
grouped gated RMSNorm — and the state shift after speculative verification two (conv window, recurrent state).

Nothing here imports `triton` until a kernel is used: `available` only asks whether it can be. Triton chooses its
interpreter (`TRITON_INTERPRET=1`, CPU tensors) or its compiler when a kernel module is first imported, so tests set
that variable before their first call (see tests/workers/model/test_triton_kernels.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.lru_cache(maxsize=1)
def _triton_imports() -> str | None:
    """Why `import triton` fails here, or None when it works (asked once per process)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    try:
        import triton  # noqa: F401
    except Exception as error:  # a broken install raises anything from ImportError to RuntimeError
        return f"import triton failed: {error}"
    return None


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: CPU tensors, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can (CUDA, or CPU under the interpreter)."""
    reason = _triton_imports()
    if reason is not None:
        return reason
    if device.type == "cuda" or (device.type == "cpu" and interpreter_on()):
        return None
    return f"Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1), not on {device.type}"


def available(device: torch.device) -> bool:
    """True when the Triton kernels can run on `device`."""
    return unavailable_reason(device) is None
