"""Whether a step could be captured in a CUDA graph, checked on any machine (NOTES.md §10).

A captured step may neither synchronise with the host (`.item()`, `.tolist()`, `int(tensor)`, `if tensor`) nor
produce shapes that depend on tensor values (`nonzero`, boolean-mask indexing), nor copy data between host and
device (a `torch.tensor([...])` of Python values inside the step is such a copy on CUDA). `find_capture_hazards`
runs the step under `FakeTensorMode` — no real arithmetic, so it is fast — with a dispatch mode that records every
such operation; FakeTensorMode itself refuses data-dependent shapes, and the copies are checked here because it
does not (on CPU every tensor is on one device, so any host data lifted into the step counts as a copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_SYNC = {aten._local_scalar_dense.default: "a device→host read (.item(), .tolist(), int(tensor), if tensor)"}
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default}
HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


class _HazardRecorder(TorchDispatchMode):
    """Records ops a CUDA graph cannot capture; lets them run (under FakeTensorMode) so one pass finds them all."""

    def __init__(self) -> None:
        super().__init__()
        self.hazards: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func in HOST_SYNC:
            self.hazards.append(HOST_SYNC[func])
        elif func in DATA_DEPENDENT or packet in (aten.nonzero, aten.unique_consecutive):
            self.hazards.append(f"a data-dependent shape ({packet.__name__})")
        elif func in HOST_DATA:
            self.hazards.append("host data copied into the step (torch.tensor of Python values)")
        elif packet in (aten._to_copy, aten.copy_, aten.copy):
            self._check_devices(packet.__name__, args, kwargs)
        return func(*args, **kwargs)

    def _check_devices(self, name: str, args: tuple, kwargs: dict) -> None:
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if kwargs.get("device") is not None:
            devices.add(torch.device(kwargs["device"]))
        if len({d.type for d in devices}) > 1:
            self.hazards.append(f"a host↔device copy ({name} between {sorted(d.type for d in devices)})")


def find_capture_hazards(step: Callable[[], Any]) -> list[str]:
    """Run `step()` under FakeTensorMode (real tensors it touches become fakes: nothing real is written) and return
    every operation that would break CUDA graph capture, in order, or [] when there is none (the first
    data-dependent one ends the run). Run `step` once for real before, as before a capture: a cache that creates
    tensors on first use (`attention.inverse_frequencies`) would otherwise keep a fake one."""
    recorder = _HazardRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True), recorder:
        try:
            step()
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            recorder.hazards.append(
                f"a data-dependent operation FakeTensorMode refused ({type(error).__name__}: {error})"
            )
    return recorder.hazards
