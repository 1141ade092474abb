"""Native CPU kernels: small C files compiled once per machine with the system C compiler, called through ctypes.

- `csrc/linear.c`: linear layers over weights packed in column panels, streamed at close to memory bandwidth
  for the few rows of a decode step (oneDNN and BLAS reach well under it there).
- `csrc/linear_int8.c`: the same panels holding int8 weights (quantization="int8"), widened to float32 in
  registers: a quarter of the bytes to stream.
- `csrc/linear_bf16.c`: bfloat16 weights (dtype="bfloat16" on CPU) in panels of k pairs, multiplied on AMX tiles,
  with AVX512-BF16, or widened to float32 (`native_bf16.py` packs them and picks the path once per process).
- `csrc/linear_w8a8.c`: int8 weights × int8 activations (quantized per row and group at each call) with
  AVX512-VNNI, exact integer sums per group (`workers/model/kernels/w8a8.py` packs and calls it).
- `csrc/mamba_decode.c`: the Mamba2 decode step, which touches every byte of the SSM state (512 KiB per request
  per layer for the bench model): several PyTorch passes plus a batched matrix-vector product, here one; and the
  prompt (prefill) pass from the zero state, token by token per head with the head's state in L1.
- `csrc/gdn_decode.c`: the Gated DeltaNet decode step (conv, l2norm, gates, delta rule, gated norm) in one pass
  per request and value head over the delta-rule state, instead of ~4 PyTorch passes and ~30 calls per layer; and
  the prompt (prefill) pass, token by token per request, value head and block of 64 state columns.
- `csrc/short_conv.c`: LFM2's gated short conv — decode step, speculative verification and keep, and the prompt
  pass.
- `csrc/attention.c`: one decode step of grouped-query attention over the slot KV cache (writes included; a sliding
  window where the layer has one), and rotary embeddings.
- `csrc/ops.c`: RMSNorm fused with the residual add, silu(gate) · up, x · sigmoid(gate), argmax (`vexp.h`:
  vectorised exp).
- `csrc/shared_block.c`: gelu(gate) · up and an elementwise add for Zamba2's shared blocks.
- `csrc/logprobs.c`: each row's log-probability of a token and its k most likely tokens (a step's logprobs).
- `csrc/decode_plan.c`: a whole decode step as one call, replaying the kernel calls `decode_plan.py` recorded.
Each is built per instruction set (`isa.py`: avx512, avx2, portable; neon on aarch64), with vectors and register
tiles sized by `csrc/simd.h`. They are float32-only (but for the int8 and bfloat16 weights of `linear_int8.c` and
`linear_bf16.c`). The PyTorch
paths stay the reference: tests compare each kernel with it, and everything works without a compiler (slower).

Builds are cached under `$HYBRIDGEN_KERNEL_CACHE` (default `~/.cache/hybridgen/kernels`) by `kernel_cache.py`,
which loads only a build this user made, unchanged since (see there). A library that loads but lacks a kernel (a
stale or foreign build) counts as unavailable, like a missing compiler.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from workers.model.kernels import kernel_cache
from workers.model.kernels.isa import ISA_ENV, ISA_FLAGS, choose_isa, cpu_isas
from workers.model.kernels.kernel_cache import NativeKernelError
from workers.model.kernels.signatures import SIGNATURES

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))  # built together into one library
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
_SELECTED: str | None = None
_LIBRARIES: dict[str, ctypes.CDLL] = {}
_LOAD_ERRORS: dict[str, str] = {}
_WARNED = False


def describe() -> str:
    """Which variant of the kernels this process runs, and why (the runner logs it)."""
    isa = selected_isa()
    if isa != cpu_isas()[0]:
        return f"{isa} kernels (forced by {ISA_ENV}; this CPU runs {', '.join(cpu_isas())})"
    return f"{isa} kernels (the fastest of {', '.join(cpu_isas())} this CPU runs)"


def selected_isa() -> str:
    """The variant this process runs: `choose_isa()` at the first call, then fixed (weights are packed for it)."""
    global _SELECTED
    if _SELECTED is None:
        _SELECTED = choose_isa()
    return _SELECTED


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


def _declare_all(lib: ctypes.CDLL, path: Path) -> None:
    """Bind every kernel `lib` must export (the only place symbols are looked up); NativeKernelError if one is
    missing, so the PyTorch paths run instead."""
    try:
        _declare(lib)
    except AttributeError as error:  # ctypes' "<file>: undefined symbol: <name>"
        raise NativeKernelError(f"{path} lacks a kernel, a stale or foreign build ({error})") from error


def load(isa: str | None = None) -> ctypes.CDLL:
    """The compiled kernel library of variant `isa` (default: `selected_isa()`), built on first use; raises
    NativeKernelError when it cannot be."""
    isa = selected_isa() if isa is None else isa
    if isa in _LIBRARIES:
        return _LIBRARIES[isa]
    if isa in _LOAD_ERRORS:
        raise NativeKernelError(_LOAD_ERRORS[isa])
    if isa not in ISA_FLAGS:
        raise ValueError(f"no kernel variant {isa!r}: choose one of {', '.join(ISA_FLAGS)}")
    try:
        compiler = _compiler()
        if compiler is None:
            raise NativeKernelError("no C compiler found (set CC, or install gcc)")
        lib, path = kernel_cache.open_library(SOURCES, HEADERS, compiler, [*CFLAGS, *ISA_FLAGS[isa]])
        _declare_all(lib, path)
    except (OSError, NativeKernelError) as error:
        _LOAD_ERRORS[isa] = f"native kernels ({isa}) unavailable: {error}"
        raise NativeKernelError(_LOAD_ERRORS[isa]) from error
    _LIBRARIES[isa] = lib
    return lib


def loaded() -> bool:
    """Whether the process's library is already built and loaded (never builds it)."""
    return _SELECTED is not None and _SELECTED in _LIBRARIES


def available() -> bool:
    """Whether the native kernels can be used here (builds them on first call; never raises; warns once)."""
    global _WARNED
    try:
        load()
    except NativeKernelError as error:
        if not _WARNED:
            logger.warning("%s; running the PyTorch / oneDNN paths instead", error)
            _WARNED = True
        return False
    return True


def flush_denormals() -> bool:
    """Flush denormal floats to zero on this thread and on the OpenMP threads PyTorch's CPU ops run on.

    Denormals (|x| < 1.2e-38) are ~100× slower on x86; decays like exp(-100) in the chunked scan produce them,
    which made prefill 2× slower. Changing them to 0 moves results by at most ~1e-38. Returns whether the pool
    threads were reached (they need the native library; the calling thread is always set).
    """
    torch.set_flush_denormal(True)
    try:
        lib = load()
    except NativeKernelError:
        return False
    lib.flush_denormals_on_threads(torch.get_num_threads())
    return True


def pointer(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"native kernels need contiguous float32 CPU tensors, got {t.dtype} on {t.device}")
    return t.data_ptr()


def pack_panels(weight: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """A [N, K] float32 weight as the [ceil(N / P), K, P] column panels `linear` reads (P: `width`, default the
    process's kernels' `linear_panel_width()`).

    Written straight into the panels (no padded copy of the weight first: loading peaks at one layer's weight
    more than the packed model, not two)."""
    width = int(load().linear_panel_width()) if width is None else width
    out_features, in_features = weight.shape
    num_panels, full = -(-out_features // width), out_features // width
    panels = weight.new_empty(num_panels, in_features, width)
    panels[:full] = weight[: full * width].view(full, width, in_features).transpose(1, 2)
    if full < num_panels:  # the last panel's missing columns are zeros
        panels[full].zero_()
        panels[full, :, : out_features - full * width] = weight[full * width :].t()
    return panels


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [M, K] · wᵀ (+ bias) → [M, out_features], with w packed by `pack_panels`; float32 on CPU."""
    lib = load()
    rows, in_features = x.shape
    if panels.shape[1] != in_features or panels.shape[0] * panels.shape[2] < out_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit panels {tuple(panels.shape)} for {out_features} outputs")
    out = torch.empty(rows, out_features)
    if rows:
        lib.linear_panels(
            pointer(x),
            pointer(panels),
            pointer(bias),
            pointer(out),
            rows,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
    return out


def pack_panels_int8(weight: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight quantized symmetrically per output channel (w ≈ q · scale[n], q in [-127, 127], rounded to
    nearest) and packed as `pack_panels` does: (int8 panels [ceil(N / P), K, P], float32 scale [N])."""
    width = int(load().linear_panel_width()) if width is None else width
    out_features, in_features = weight.shape
    weight = weight.float()
    scale = torch.maximum(weight.amax(dim=1), -weight.amin(dim=1)) / 127  # max |w| without a copy of |w|
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    num_panels = -(-out_features // width)
    panels = torch.zeros(num_panels, in_features, width, dtype=torch.int8)
    step = max(1, (2 << 20) // (4 * width * max(1, in_features)))  # panels per pass: ~2 MiB of float temporaries
    for first in range(0, num_panels, step):  # no float copy of the whole weight
        rows = slice(first * width, min(out_features, (first + step) * width))
        q = (weight[rows] / scale[rows, None]).round_().clamp_(-127, 127).to(torch.int8)
        count = -(-q.shape[0] // width)
        padded = q.new_zeros(count * width, in_features)
        padded[: q.shape[0]] = q
        panels[first : first + count] = padded.view(count, width, in_features).transpose(1, 2)
    return panels, scale.contiguous()


def linear_int8(
    x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [M, K] · (q · scale)ᵀ (+ bias) → [M, out_features], with q, scale from `pack_panels_int8`; CPU."""
    lib = load()
    rows, in_features = x.shape
    if panels.dtype != torch.int8 or panels.shape[1] != in_features or panels.shape[0] * panels.shape[2] < out_features:
        raise ValueError(
            f"x {tuple(x.shape)} does not fit int8 panels {tuple(panels.shape)} for {out_features} outputs"
        )
    out = torch.empty(rows, out_features)
    if rows:
        lib.linear_panels_int8(
            pointer(x),
            panels.data_ptr(),
            pointer(scale),
            pointer(bias),
            pointer(out),
            rows,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
    return out


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors as they are: contiguous float32 on CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., d] with weight [d]."""
    out = torch.empty_like(x)
    d = x.shape[-1]
    load().rms_norm(pointer(x), pointer(weight), eps, pointer(out), x.numel() // d, d, torch.get_num_threads())
    return out


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, alpha: float, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """hidden += alpha · delta in place; returns rmsnorm(hidden) · weight (a residual add and the next norm)."""
    out = torch.empty_like(hidden)
    d = hidden.shape[-1]
    load().add_rms_norm(
        pointer(hidden),
        pointer(delta),
        alpha,
        pointer(weight),
        eps,
        pointer(out),
        hidden.numel() // d,
        d,
        torch.get_num_threads(),
    )
    return out


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for h [..., 2n] = [gate | up] → [..., n]."""
    n = h.shape[-1] // 2
    out = h.new_empty(*h.shape[:-1], n)
    load().silu_mul(pointer(h), pointer(out), h.numel() // (2 * n), n, torch.get_num_threads())
    return out


def gelu_mul(h: torch.Tensor) -> torch.Tensor:
    """gelu(gate) · up (the erf form, F.gelu's default) for h [..., 2n] = [gate | up] → [..., n] (Zamba2's MLP)."""
    n = h.shape[-1] // 2
    out = h.new_empty(*h.shape[:-1], n)
    load().gelu_mul(pointer(h), pointer(out), h.numel() // (2 * n), n, torch.get_num_threads())
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x · sigmoid(gate) for x, gate [..., n] of the same shape (gated attention's output gate)."""
    if x.shape != gate.shape:
        raise ValueError(f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must have the same shape")
    out = torch.empty_like(x)
    n = x.shape[-1]
    load().sigmoid_mul(pointer(x), pointer(gate), pointer(out), x.numel() // n, n, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for x [rows, n] (first index on ties; NaN counts as the largest)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    load().argmax_rows(pointer(x), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def logprobs(x: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits x [rows, n] and tokens [rows] (int64, each in [0, n)): (log p(token) [rows], the k most likely
    token ids [rows, k] and their log-probabilities [rows, k]) — log_softmax, gather and topk in two reads of the
    logits (ties rank the lower index first, −inf entries too; ids −1 past the row's n entries when k > n)."""
    rows, n = x.shape
    tokens = tokens.to(torch.int64).contiguous()
    if tokens.shape != (rows,) or (rows and not 0 <= int(tokens.min()) <= int(tokens.max()) < n):
        raise ValueError(f"tokens must be {rows} ids in [0, {n})")
    token_logprobs = torch.empty(rows, dtype=torch.float32)
    top_ids, top_logprobs = torch.empty(rows, k, dtype=torch.int64), torch.empty(rows, k, dtype=torch.float32)
    load().logprobs_rows(
        pointer(x),
        tokens.data_ptr(),
        rows,
        n,
        k,
        token_logprobs.data_ptr(),
        top_ids.data_ptr(),
        top_logprobs.data_ptr(),
        torch.get_num_threads(),
    )
    return token_logprobs, top_ids, top_logprobs


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int) -> None:
    """Rotary embedding of x [b, heads, head_dim] in place, row r at positions[r] (int64), inv_freq [rotary_dim / 2]."""
    if not (positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == x.shape[:1]):
        raise ValueError("positions must be a contiguous int64 tensor with one entry per row")
    b, heads, head_dim = x.shape
    load().rope_rows(pointer(x), positions.data_ptr(), pointer(inv_freq), b, heads, head_dim, rotary_dim)


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: Any,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One new token per row: write k, v [b, KV, d] at `positions` of `slot_ids` in the paged `cache` (a
    `KVCache`: key/value [KV, tokens, d] over its block table), then attend q [b, H, d] over positions
    0 … position of each row → [b, H, d]; with a sliding `window`, over its last `window` positions only."""
    b, num_heads, head_dim = q.shape
    blocks = cache.blocks
    if not (
        slot_ids.dtype == positions.dtype == torch.int64 and slot_ids.is_contiguous() and positions.is_contiguous()
    ):
        raise ValueError("slot_ids and positions must be contiguous int64 tensors")
    last = int(positions.max())
    if last >= blocks.max_blocks_per_slot * blocks.block_size:
        raise ValueError(f"position {last} is past the KV capacity of a slot")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 position, got {window}")
    out = torch.empty_like(q)
    load().attention_verify_window(
        pointer(q),
        pointer(k),
        pointer(v),
        pointer(cache.key),
        pointer(cache.value),
        blocks.tables.data_ptr(),
        blocks.max_blocks_per_slot,
        blocks.block_size,
        cache.key.shape[1],
        slot_ids.data_ptr(),
        positions.data_ptr(),
        scale,
        pointer(out),
        b,
        1,
        num_heads,
        cache.key.shape[0],
        head_dim,
        window or 0,
        torch.get_num_threads(),
    )
    return out
