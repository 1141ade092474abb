"""The Mamba (version 1) mixer of Jamba.

in_proj → [x, z]; causal depthwise conv (SiLU) over x; x_proj(x) → [dt (r), B (n), C (n)], each RMS-normed
(Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`); dt = softplus(dt_proj(dt)) per channel; selective scan with
A [i, n] = −exp(A_log); y + D·x, gated by silu(z); out_proj. State comes in as a `RecurrentState` (conv window
[i, W-1], SSM state [i, n]) and the new one is returned. Parameter names follow the hub checkpoints.

`decode_kernel` "native" (CPU float32, set at load): the ops between the four linears run in
`kernels/native_mamba1.py` (csrc/mamba1_decode.c) — the in-place decode step, and every other forward (prompts,
verification from a kept state) through the native prefill scan; the decode plan calls the same kernels between
the same linears, so the two agree bit for bit. "triton" (CUDA, set at load): the in-place decode step and the
state shift after verification through `kernels/triton_kernels/mamba1.py`. "torch" is the reference (any dtype, any
device).

Tensor parallel (built from a rank's local config, d_inner i_l = i/T): the rank holds channels `[r·i_l, +i_l)` of x,
z, the conv, dt_proj's rows, A_log, D, and x_proj's input columns. x_proj's output (dt, B, C) is then a partial sum,
all-reduced here before the inner norms (every rank needs the whole dt, B, C); out_proj is row-parallel, its output
a partial sum the model all-reduces (its bias on rank 0 only). Two all-reduces per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule, columns, rows
from workers.model.kernels import native_mamba1
from workers.model.kernels.selective_scan import selective_scan, selective_state_after, selective_step_
from workers.model.kernels.ssd import causal_conv, conv_step_, conv_window_after
from workers.model.layers.norm import RMSNorm
from workers.model.state import RecurrentState


@dataclass
class SelectiveScanInputs:
    """What one Mamba1 layer computed from its input tokens: enough to rebuild its state after any prefix."""

    conv_in: torch.Tensor  # [b, l, i] inputs of the causal conv (x before the conv)
    x: torch.Tensor  # [b, l, i] scan input (after conv + silu)
    B: torch.Tensor  # [b, l, n] after b_layernorm
    dt: torch.Tensor  # [b, l, i] float32, after softplus, 0 at padding


class Mamba1Mixer(nn.Module):
    """Selective state-space mixer (Mamba1, Jamba); `forward` has the same contract as `Mamba2Mixer.forward`."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the tensor-parallel group."""
        super().__init__()
        m = config.mamba1
        self.config = m
        self.tp = tp
        i, n, r = m.intermediate_size, m.state_size, m.dt_rank
        self.in_proj = nn.Linear(config.hidden_size, 2 * i, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(i, i, m.conv_kernel, groups=i, bias=m.conv_bias)
        self.x_proj = nn.Linear(i, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, i, bias=True)
        # A_log and D are kept in float32 whatever the weight dtype (see loader).
        self.A_log = nn.Parameter(torch.zeros(i, n))
        self.D = nn.Parameter(torch.ones(i))
        self.out_proj = nn.Linear(i, config.hidden_size, bias=m.proj_bias)
        self.dt_layernorm = RMSNorm(r, config.rms_norm_eps)
        self.b_layernorm = RMSNorm(n, config.rms_norm_eps)
        self.c_layernorm = RMSNorm(n, config.rms_norm_eps)
        self.decode_kernel = "torch"  # "torch", "native" (C, CPU float32) or "triton"; set at load
        self._A: tuple[tuple[int, int], torch.Tensor] | None = None  # (A_log's pointer and version, −exp(A_log))

    def shard_rules(self) -> dict[str, ShardRule]:
        """How each parameter of this rank is cut from the unsplit mixer's (the layout in the module docstring)."""
        width = self.config.intermediate_size  # i_l
        mine = (self.tp.rank * width, width)
        projection = rows(mine, (self.tp.size * width + mine[0], width))
        channels = rows(mine)
        rules = {"in_proj.weight": projection, "x_proj.weight": columns(mine), "out_proj.weight": columns(mine)}
        rules.update({"conv1d.weight": channels, "dt_proj.weight": channels, "dt_proj.bias": channels})
        rules.update({"A_log": channels, "D": channels})
        if self.in_proj.bias is not None:
            rules["in_proj.bias"] = projection
        if self.conv1d.bias is not None:
            rules["conv1d.bias"] = channels
        if self.out_proj.bias is not None:
            rules["out_proj.bias"] = ShardRule(rank0_only=True)
        return rules

    def native_A(self) -> torch.Tensor:
        """A = −exp(A_log) [i, n] float32, contiguous, as the native kernels take it: computed once (again only
        when A_log changes), the tensor the decode plan records."""
        try:
            key = (self.A_log.data_ptr(), self.A_log._version)
        except RuntimeError:  # an inference tensor has no version counter (and cannot change in place outside it)
            key = (self.A_log.data_ptr(), -1)
        if self._A is None or self._A[0] != key:
            self._A = (key, (-torch.exp(self.A_log.detach().float())).contiguous())
        return self._A[1]

    def _ssm_inputs(self, x: torch.Tensor, num_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv output x [b, l, i] → (dt [b, l, i] float32 after softplus and 0 at padding, B, C [b, l, n])."""
        m = self.config
        xdbc = self.tp.group.all_reduce_(self.x_proj(x))  # partial over the ranks' channels under TP
        time_step, B, C = xdbc.split([m.dt_rank, m.state_size, m.state_size], dim=-1)
        B, C = self.b_layernorm(B.contiguous()), self.c_layernorm(C.contiguous())
        dt = F.softplus(self.dt_proj(self.dt_layernorm(time_step.contiguous())).float())
        valid = torch.arange(dt.shape[1], device=dt.device)[None, :] < num_tokens[:, None]  # [b, l]
        return dt * valid[..., None], B, C

    def forward(
        self, hidden: torch.Tensor, state: RecurrentState | None, num_tokens: torch.Tensor, in_place: bool = False
    ) -> tuple[torch.Tensor, RecurrentState, SelectiveScanInputs]:
        """hidden [b, l, d] → (out [b, l, d], state after each row's last valid token, the scan's inputs).

        `state` None: every row starts its sequence here (zero state). `in_place` (one token per row, with a
        state): update `state`'s tensors instead of allocating new ones — the decode loop's path, for callers that
        never need the old state again. No host synchronisation on any path (a CUDA graph may capture it).
        """
        m = self.config
        b, length, _ = hidden.shape
        if self.decode_kernel == "native":
            contiguous = state is not None and state.conv.is_contiguous() and state.ssm.is_contiguous()
            if in_place and length == 1 and contiguous:
                return self._native_decode(hidden, state), state, None
            return self._native_prefill(hidden, num_tokens, state)
        in_place = in_place and length == 1 and state is not None and state.ssm.is_contiguous()
        if in_place and self.decode_kernel == "triton":
            return self._triton_decode(hidden, state), state, None
        # 1. Projections: x and the gate z.
        conv_in, z = self.in_proj(hidden).split([m.intermediate_size, m.intermediate_size], dim=-1)
        # 2. Causal conv (+ SiLU) over x, continuing the stored window.
        weight = self.conv1d.weight.squeeze(1)
        if in_place:
            x, conv_state = conv_step_(conv_in, state.conv, weight, self.conv1d.bias), state.conv
        else:
            previous = hidden.new_zeros(b, m.intermediate_size, m.conv_kernel - 1) if state is None else state.conv
            x, conv_state = causal_conv(conv_in, previous, weight, self.conv1d.bias, num_tokens)
        # 3. Input-dependent dt, B, C, then the selective scan.
        dt, B, C = self._ssm_inputs(x, num_tokens)
        A = -torch.exp(self.A_log.float())
        if in_place:
            y = selective_step_(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state.ssm)[:, None]
            ssm_state = state.ssm
        else:
            y, ssm_state = selective_scan(x, dt, A, B, C, None if state is None else state.ssm, m.chunk_size)
        # 4. D skip, gate, output projection.
        y = (y + self.D.float() * x.float()) * F.silu(z.float())
        out = self.out_proj(y.to(hidden.dtype))
        return out, RecurrentState(conv_state, ssm_state), SelectiveScanInputs(conv_in, x, B, dt)

    def _native_inner(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_proj, the inner norms and dt_proj over the conv output xc [..., i] → (x_proj output [..., r + 2n] with B,
        C normed, dt_proj output [..., i] before softplus)."""
        xdbc = self.tp.group.all_reduce_(self.x_proj(xc).contiguous())  # partial over the ranks' channels under TP
        dt_in = native_mamba1.norms(
            xdbc, self.dt_layernorm.weight, self.b_layernorm.weight, self.c_layernorm.weight, self.dt_layernorm.eps
        )
        return xdbc, self.dt_proj(dt_in).contiguous()

    def _native_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """One token per row through the native kernels, updating `state` in place; hidden [b, 1, d]."""
        proj = self.in_proj(hidden[:, 0]).contiguous()  # [b, 2i]
        xc = native_mamba1.conv(proj, state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias, advance=True)
        xdbc, dt_raw = self._native_inner(xc)
        y = native_mamba1.ssm(proj, xc, xdbc, dt_raw, self.native_A(), self.D, state.ssm, in_place=True)
        return self.out_proj(y)[:, None]

    def _native_prefill(
        self, hidden: torch.Tensor, num_tokens: torch.Tensor, state: RecurrentState | None
    ) -> tuple[torch.Tensor, RecurrentState, SelectiveScanInputs | None]:
        """Prompts (from the zero state: no scan inputs) or tokens from a kept state (a verification, the next chunk
        of a prompt; with the scan inputs `state_after` shifts from) through the native conv and prefill scan."""
        m = self.config
        proj = self.in_proj(hidden).contiguous()  # [b, l, 2i]
        num_tokens = num_tokens.contiguous()
        weight = self.conv1d.weight.squeeze(1)
        xc, conv = native_mamba1.prefill_conv(
            proj, num_tokens, weight, self.conv1d.bias, None if state is None else state.conv.contiguous()
        )
        xdbc, dt_raw = self._native_inner(xc)
        initial = None if state is None else state.ssm.contiguous()
        y, ssm, dt = native_mamba1.prefill_scan(proj, num_tokens, xc, xdbc, dt_raw, self.native_A(), self.D, initial)
        out = self.out_proj(y)
        if state is None:
            return out, RecurrentState(conv, ssm), None
        B = xdbc[..., m.dt_rank : m.dt_rank + m.state_size]
        return out, RecurrentState(conv, ssm), SelectiveScanInputs(proj[..., : m.intermediate_size], xc, B, dt)

    def _triton_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """The one-token step through the Triton kernels (conv step, selective update with D skip and gate; state in
        place) around the same x_proj, inner norms and dt_proj; hidden [b, 1, d]."""
        from workers.model.kernels.triton_kernels import common, mamba1

        i = self.config.intermediate_size
        proj = self.in_proj(hidden[:, 0])  # [b, 2i]: x | z
        x = common.conv_step_(proj[:, :i], state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias)
        dt, B, C = self._ssm_inputs(x[:, None], torch.ones_like(x[:, 0], dtype=torch.long))
        y = mamba1.selective_step_(x, dt[:, 0], self.A_log, B[:, 0], C[:, 0], self.D, proj[:, i:], state.ssm)
        return self.out_proj(y)[:, None]

    def state_after(
        self, state: RecurrentState, scan: SelectiveScanInputs, num_tokens: torch.Tensor, static_shapes: bool = False
    ) -> RecurrentState:
        """The state after each row's first `num_tokens` inputs of a forward that started from `state`.

        Speculative decoding's state shifting: verification runs k+1 tokens, then keeps the state after input
        num_accepted_tokens − 1. The conv window is a gather; the SSM state [i, n] re-runs the ≤ k + 1 steps from
        the step's start state over the kept x, dt, B, with dt zeroed past each row's count (those steps are
        no-ops). That keeps [b, l, i] + [b, l, n] scan inputs per layer instead of l states [b, l, i, n] (n = 16
        times more). Its shapes never depend on `num_tokens`'s values (`static_shapes` changes nothing here).
        """
        if self.decode_kernel == "triton":
            from workers.model.kernels.triton_kernels.mamba1 import mamba1_shift_

            new = RecurrentState(state.conv.clone(), state.ssm.clone())
            mamba1_shift_(new.conv, new.ssm, scan.conv_in, scan.x, scan.B, scan.dt, self.A_log, num_tokens)
            return new
        conv = conv_window_after(state.conv, scan.conv_in, num_tokens)
        if self.decode_kernel == "native":  # the decode step's arithmetic, as the plan's keep
            counts = num_tokens.to(torch.int64).contiguous()
            return RecurrentState(
                conv, native_mamba1.state_after(scan.x, scan.dt, scan.B, self.native_A(), state.ssm, counts)
            )
        valid = torch.arange(scan.dt.shape[1], device=scan.dt.device)[None, :] < num_tokens[:, None]
        A = -torch.exp(self.A_log.float())
        return RecurrentState(
            conv,
            selective_state_after(scan.x, scan.dt * valid[..., None], A, scan.B, state.ssm),
        )
