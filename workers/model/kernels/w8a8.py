"""int8 × int8 linears (csrc/linear_w8a8.c): weight packing at load and the call, with the kernel's quantization rules
written once more in PyTorch (`quantize_weight`, `quantize_activations`) for the reference and the tests.

Glossary: M rows, N outputs, K inputs, G inputs per quantization group (a multiple of 4), Kp = groups · G (K
zero-padded), P = 48 outputs per panel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.kernels.native import load, pointer

PANEL = 48
PATHS = {"auto": 0, "portable": 1, "vnni": 2, "avx2": 3}  # csrc/linear_w8a8.c's PATH_* values


@dataclass(frozen=True)
class W8A8Panels:
    """A weight packed for the int8 × int8 kernel."""

    panels: torch.Tensor  # [ceil(N / P), Kp / 4, P, 4] int8
    scale: torch.Tensor  # [ceil(N / P), groups, P] float32: sw[n, g]
    correction: torch.Tensor  # [ceil(N / P), groups, P] int32: 128 · Σ_{k in g} q[n, k]
    group_size: int  # G
    out_features: int  # N
    in_features: int  # K


def group_size_for(in_features: int, group_size: int | None) -> int:
    """G for a weight of `in_features` inputs: `group_size` (a positive multiple of 4), or None for one group per
    output channel (K rounded up to a multiple of 4)."""
    if group_size is None:
        return -(-in_features // 4) * 4
    if group_size <= 0 or group_size % 4:
        raise ValueError(f"group_size={group_size} is invalid: must be a positive multiple of 4 (or None)")
    return group_size


def quantize_weight(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel and group of `group_size` inputs, rounded to nearest (even):
    (q [N, groups, G] int8 over K zero-padded to groups · G, scale [N, groups] float32), w ≈ q · scale; an all-zero
    group keeps scale 1."""
    out_features, in_features = weight.shape
    groups = -(-in_features // group_size)
    padded = weight.float().new_zeros(out_features, groups * group_size)
    padded[:, :in_features] = weight.float()
    grouped = padded.view(out_features, groups, group_size)
    scale = torch.maximum(grouped.amax(dim=2), -grouped.amin(dim=2)) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (grouped / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 → (q [M, groups, G] int8, scale [M, groups]) exactly as the kernel does: q =
    round-half-even(clamp(x · (127 / max|x|), ±127)), scale = max|x| / 127 (0 for an all-zero group)."""
    rows, in_features = x.shape
    groups = -(-in_features // group_size)
    padded = x.new_zeros(rows, groups * group_size)
    padded[:, :in_features] = x
    grouped = padded.view(rows, groups, group_size)
    amax = grouped.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = (grouped * inv[..., None]).clamp_(-127, 127).round_().to(torch.int8)
    return q, amax / 127


def pack(weight: torch.Tensor, group_size: int | None) -> W8A8Panels:
    """Quantize a [N, K] weight (`quantize_weight`) and pack it for `linear`, a few panels at a time (~2 MiB of float
    temporaries: no float copy of the whole weight)."""
    out_features, in_features = weight.shape
    size = group_size_for(in_features, group_size)
    num_panels, groups = -(-out_features // PANEL), -(-in_features // size)
    panels = torch.zeros(num_panels, groups * size // 4, PANEL, 4, dtype=torch.int8)
    scale = torch.ones(num_panels, groups, PANEL)
    correction = torch.zeros(num_panels, groups, PANEL, dtype=torch.int32)
    step = max(1, (2 << 20) // (4 * PANEL * groups * size))  # panels per pass
    for first in range(0, num_panels, step):
        rows = slice(first * PANEL, min(out_features, (first + step) * PANEL))
        q, part_scale = quantize_weight(weight[rows], size)  # [n, groups, G], [n, groups]
        count = -(-q.shape[0] // PANEL)
        padded = q.new_zeros(count * PANEL, groups * size)
        padded[: q.shape[0]] = q.view(q.shape[0], -1)
        # [count, P, Kp / 4, 4] → [count, Kp / 4, P, 4]
        panels[first : first + count] = padded.view(count, PANEL, -1, 4).transpose(1, 2)
        sums = q.sum(dim=2, dtype=torch.int32) * 128
        for target, values, pad in ((scale, part_scale, 1), (correction, sums, 0)):  # padded columns: 1, 0
            full = values.new_full((count * PANEL, groups), pad)
            full[: q.shape[0]] = values
            target[first : first + count] = full.view(count, PANEL, groups).transpose(1, 2)
    return W8A8Panels(panels, scale, correction, size, out_features, in_features)


def available_paths() -> list[str]:
    """The kernel paths this CPU runs: "portable" always, "vnni" where AVX512-VNNI is built and present, "avx2"
    where the kernels are built with AVX2 (the avx512 and avx2 variants)."""
    mask = int(load().linear_w8a8_paths())
    return [name for name, bit in PATHS.items() if name != "auto" and mask >> bit & 1]


def linear(x: torch.Tensor, packed: W8A8Panels, bias: torch.Tensor | None, path: str = "auto") -> torch.Tensor:
    """x [M, K] float32 (contiguous) · wᵀ (+ bias) → [M, N] with int8 × int8 sums; `path` forces a kernel path
    ("portable", "vnni", "avx2"; all give the same bits)."""
    lib = load()
    rows, in_features = x.shape
    if in_features != packed.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {packed.in_features} inputs")
    if path not in PATHS or (path != "auto" and path not in available_paths()):
        raise ValueError(f"path={path!r} is invalid here: must be 'auto' or one of {', '.join(available_paths())}")
    out = torch.empty(rows, packed.out_features)
    if rows:
        lib.linear_panels_w8a8(
            pointer(x),
            packed.panels.data_ptr(),
            pointer(packed.scale),
            packed.correction.data_ptr(),
            pointer(bias),
            pointer(out),
            rows,
            packed.out_features,
            in_features,
            packed.group_size,
            PATHS[path],
            torch.get_num_threads(),
        )
    return out


def rescore_top(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logits: torch.Tensor, top_k: int):
    """In place: the `top_k` largest of each row of logits [M, N] (ties: the lower index) recomputed in float32
    as x [M, K] · weight[n] (+ bias[n]) from the float weight [N, K]."""
    rows, in_features = x.shape
    if weight.shape != (logits.shape[1], in_features) or logits.shape[0] != rows:
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, logits {tuple(logits.shape)} disagree")
    if rows:
        load().rescore_top_logits(
            pointer(x),
            pointer(weight),
            pointer(bias),
            pointer(logits),
            rows,
            weight.shape[0],
            in_features,
            top_k,
            torch.get_num_threads(),
        )
