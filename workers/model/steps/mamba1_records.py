"""The records of a Mamba1 (Jamba) mixer in a decode plan: the calls `Mamba1Mixer._native_decode` makes, with the
verification and keep forms (csrc/mamba1_decode.c), so plan and module agree bit for bit.

One step of a Mamba1 layer is four native linears with three small ops between them:
in_proj → MAMBA1_CONV (conv window step + SiLU) → x_proj → MAMBA1_NORMS (the dt / B / C RMS norms) → dt_proj →
MAMBA1_SSM (softplus, the selective state update, D skip, silu(z) gate) → out_proj.
A verification runs the same records over l tokens per row, leaving the states as they were, and keeps the layer's
in_proj, x_proj and dt_proj outputs (`kept_width` floats per token); MAMBA1_SHIFT then advances each row's states
by its accepted tokens from them.
"""

from __future__ import annotations

import torch

from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.steps.plan_records import Op, Recorder, scratch_rows


def kept_width(mixer: Mamba1Mixer) -> int:
    """Floats per token a verification keeps for the keep: in_proj (2i), x_proj (r + 2n) and dt_proj (i) outputs."""
    m = mixer.config
    return 3 * m.intermediate_size + m.dt_rank + 2 * m.state_size


class Mamba1Scratch:
    """A decode step's buffers for up to `tokens` rows of the Mamba1 mixers in `mixers`: x_proj outputs, the
    normed dt slices (dt_proj's input) and dt_proj outputs (a verification writes x_proj and dt_proj outputs into
    the kept buffers instead)."""

    def __init__(self, mixers: list[Mamba1Mixer], tokens: int):
        widest = lambda values: max(values, default=0)  # noqa: E731
        configs = [mixer.config for mixer in mixers]
        self.xdbc = torch.empty(tokens * widest(m.dt_rank + 2 * m.state_size for m in configs))
        self.dt_in = torch.empty(tokens * widest(m.dt_rank for m in configs))
        self.dt = torch.empty(tokens * widest(m.intermediate_size for m in configs))


def _buffers(plan: object, mixer: Mamba1Mixer, layer: int, n: int, length: int) -> tuple[torch.Tensor, ...]:
    """(proj [n, 2i], xdbc [n, r + 2n], dt_raw [n, i]) of one step: the layer's kept buffer through a verification
    (the keep re-runs tokens from it), else scratch."""
    m = mixer.config
    i, width = m.intermediate_size, m.dt_rank + 2 * m.state_size
    if length > 1:
        kept = plan.kept_proj[layer]
        proj = kept[: n * 2 * i].view(n, 2 * i)
        xdbc = kept[n * 2 * i : n * (2 * i + width)].view(n, width)
        return proj, xdbc, kept[n * (2 * i + width) : n * (3 * i + width)].view(n, i)
    scratch = plan.mamba1_scratch
    return scratch_rows(plan.wide, n, 2 * i), scratch_rows(scratch.xdbc, n, width), scratch_rows(scratch.dt, n, i)


def record_mamba1(rec: Recorder, mixer: Mamba1Mixer, layer: int, plan: object) -> None:
    """A Mamba1 block's records for all rows · length tokens (token-major), reading `plan.normed` and writing
    `plan.mixed`; a decode step (length 1) updates the pool's states in place, a verification reads them only."""
    m, b, length, n = mixer.config, rec.rows, rec.length, rec.rows * rec.length
    i, r, size = m.intermediate_size, m.dt_rank, m.state_size
    proj, xdbc, dt_raw = _buffers(plan, mixer, layer, n, length)
    xc = scratch_rows(plan.xbc, n, i)
    dt_in = scratch_rows(plan.mamba1_scratch.dt_in, n, r)
    y = scratch_rows(plan.narrow, n, i)
    A = mixer.native_A()
    plan._referenced.append(A)
    conv, ssm = plan.pool.conv[layer], plan.pool.ssm[layer]
    rec.linear(mixer.in_proj, plan.normed[:n], proj)
    advance = int(length == 1)  # a verification leaves the windows as they are
    rec.emit(
        Op.MAMBA1_CONV, [proj, conv, mixer.conv1d.weight, mixer.conv1d.bias, xc, b, length, i, m.conv_kernel, advance]
    )
    rec.linear(mixer.x_proj, xc, xdbc)
    norms = (mixer.dt_layernorm.weight, mixer.b_layernorm.weight, mixer.c_layernorm.weight)
    rec.emit(Op.MAMBA1_NORMS, [xdbc, *norms, dt_in, n, r, size], (mixer.dt_layernorm.eps,))
    rec.linear(mixer.dt_proj, dt_in, dt_raw)
    rec.emit(Op.MAMBA1_SSM, [proj, xc, xdbc, dt_raw, A, mixer.D, ssm, y, b, length, i, r, size, advance])
    rec.linear(mixer.out_proj, y, plan.mixed[:n])


def record_mamba1_shift(rec: Recorder, mixer: Mamba1Mixer, layer: int, plan: object) -> None:
    """The keep record of a Mamba1 layer after a verification of rec.length tokens per row (decode_plan_shift)."""
    m, b, length, n = mixer.config, rec.rows, rec.length, rec.rows * rec.length
    proj, xdbc, dt_raw = _buffers(plan, mixer, layer, n, length)
    A = mixer.native_A()
    plan._referenced.append(A)
    rec.emit(
        Op.MAMBA1_SHIFT,
        [
            proj,
            plan.pool.conv[layer],
            mixer.conv1d.weight,
            mixer.conv1d.bias,
            xdbc,
            dt_raw,
            A,
            plan.pool.ssm[layer],
            scratch_rows(plan.xbc, n, m.intermediate_size),
            b,
            length,
            m.intermediate_size,
            m.dt_rank,
            m.state_size,
            m.conv_kernel,
        ],
    )
