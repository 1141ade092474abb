"""The process's heap, tuned for inference on glibc: freed buffers kept mapped for reuse during generation, and
packing's temporaries handed back while loading. Nothing changes on other C libraries, or with
`HYBRIDGEN_MALLOC_TUNING=0`."""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters (malloc.h) and what `keep_freed_memory_mapped` sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_RETAIN_BYTES = 1 << 30
MALLOC_TUNING_ENV = "HYBRIDGEN_MALLOC_TUNING"
_heap_tuned: bool | None = None


def keep_freed_memory_mapped() -> bool:
    """Let this process reuse the memory of freed CPU buffers instead of handing it back to the OS (glibc only;
    once per process; `HYBRIDGEN_MALLOC_TUNING=0` leaves malloc as it is).

    glibc maps each large buffer on its own (above 128 KiB at first, a threshold that adapts up to 32 MiB) and
    unmaps it when freed, so a prompt's per-layer buffers (a Gated DeltaNet layer's states for 32 rows of gdn-bench:
    16 MiB) keep coming back as fresh pages, each 4 KiB zeroed by a page fault: one layer's prefill measured 40-55 ms
    instead of 10 in a VM. With mmap_threshold and trim_threshold at 1 GiB, buffers up to that size come from the
    heap and up to 1 GiB of freed heap stays mapped for the next one — what the tcmalloc or jemalloc that vLLM-CPU
    recommends preloading do. The model's load temporaries are returned first (malloc_trim), so the resident memory
    after loading does not grow. Returns whether it applied.
    """
    global _heap_tuned
    if _heap_tuned is None:
        _heap_tuned = False
        if os.environ.get(MALLOC_TUNING_ENV, "1") != "0" and sys.platform == "linux":
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.malloc_trim(0)
                _heap_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_RETAIN_BYTES)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, HEAP_RETAIN_BYTES)
                )
            except (OSError, AttributeError):  # not glibc (musl, …): its allocator as it is
                _heap_tuned = False
    return _heap_tuned


def return_freed_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim; nothing elsewhere). The loader calls it after
    each block, whose float32 weights its packed ones just replaced: packing's temporaries otherwise stay resident
    between the packed panels (measured: 1.29× → 1.22× the int8 weights at the peak of a 48-block MoE load)."""
    if sys.platform == "linux" and os.environ.get(MALLOC_TUNING_ENV, "1") != "0":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
