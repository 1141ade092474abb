"""The Mamba2 mixer shared by Granite 4.0-H, Bamba and Nemotron-H.

in_proj → causal depthwise conv over xBC → SSD scan → grouped gated RMSNorm → out_proj.
State (conv window, SSM state) comes in as a `MambaState` and the new one is returned.

Tensor parallel (built from a rank's local config): the rank holds heads `[r·h_l, +h_l)` with their x, z, dt, A_log,
D, dt_bias and norm channels, and the B/C groups those heads read (g/T of them, or one group replicated on T/g
ranks). out_proj is row-parallel: the output is a partial sum the model all-reduces (its bias on rank 0 only). The
gated norm is local when every norm group lies on one rank; otherwise (`norm_span` > 1) it all-reduces each group's
sum of squares (`SpanningGatedRMSNorm`), and the fused native/Triton kernels, which norm locally, are not used
(`MambaConfig.fused_kernels_fit`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, mamba_groups
from workers.model.distributed.slices import ShardRule, columns, rows
from workers.model.kernels import native_recurrent
from workers.model.kernels.ssd import (
    causal_conv,
    compiled_ssm_step_,
    conv_step_,
    conv_window_after,
    ssd_chunked,
    ssm_state_after,
    ssm_step,
    ssm_step_,
)
from workers.model.layers.norm import GatedRMSNorm, SiluGate, SpanningGatedRMSNorm
from workers.model.state import MambaState, ScanInputs

# Up to this many new tokens per row from a kept state (speculative verification: k + 1; a draft model's steps),
# the native kernel runs them one by one on a scratch copy; longer inputs (prompts) take the chunked scan.
NATIVE_STEPWISE_MAX_TOKENS = 8


class Mamba2Mixer(nn.Module):
    """Selective state-space mixer; parameter names follow the hub checkpoints."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the tensor-parallel group."""
        super().__init__()
        m = config.mamba
        self.config = m
        self.tp = tp
        self.in_proj = nn.Linear(config.hidden_size, m.intermediate_size + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim, bias=m.conv_bias)
        # A_log, D and dt_bias are kept in float32 whatever the weight dtype (see loader).
        self.dt_bias = nn.Parameter(torch.zeros(m.num_heads))
        self.A_log = nn.Parameter(torch.zeros(m.num_heads))
        self.D = nn.Parameter(torch.ones(m.num_heads))
        eps = config.rms_norm_eps if m.norm_eps is None else m.norm_eps
        if m.rms_norm and m.norm_span > 1:
            self.norm: nn.Module = SpanningGatedRMSNorm(m.intermediate_size, eps, m.norm_before_gate, tp, m.norm_span)
        elif m.rms_norm:
            self.norm = GatedRMSNorm(m.intermediate_size, m.num_groups, eps, m.norm_before_gate)
        else:
            self.norm = SiluGate()
        out_bias = m.proj_bias if m.out_proj_bias is None else m.out_proj_bias
        self.out_proj = nn.Linear(m.intermediate_size, config.hidden_size, bias=out_bias)
        self.decode_kernel = "torch"

    @property
    def decode_kernel(self) -> str:
        """How one-token steps run: "torch", "compile", "native" or "triton" (set at load)."""
        return self._decode_kernel

    @decode_kernel.setter
    def decode_kernel(self, kernel: str) -> None:
        # The fused kernels norm rmsnorm(y · silu(z)) over groups on this rank: refuse them where that is not the
        # mixer's norm (another variant, or a norm spanning ranks) rather than compute something else.
        if kernel in ("native", "triton") and not self.config.fused_kernels_fit:
            raise ValueError(
                f"decode_kernel={kernel!r} cannot compute this Mamba2 mixer's norm (rms_norm={self.config.rms_norm}, "
                f"norm_before_gate={self.config.norm_before_gate}, norm_span={self.config.norm_span}); use 'torch'"
            )
        self._decode_kernel = kernel

    def shard_rules(self) -> dict[str, ShardRule]:
        """How each parameter of this rank is cut from the unsplit mixer's (the layout in the module docstring)."""
        return mamba2_shard_rules(self)

    def scan_inputs(self, hidden: torch.Tensor, num_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Project hidden [b, l, d] into (z [b, l, i], xbc [b, l, conv_dim], dt [b, l, h] float32).

        dt is softplus(dt + dt_bias) clamped to the family's limits, and 0 at padded positions.
        """
        m = self.config
        z, xbc, dt = self.in_proj(hidden).split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        return z, xbc, self._dt(dt, num_tokens)

    def _dt(self, dt_raw: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) clamped to the family's limits, 0 at padded positions; [b, l, h] float32."""
        m = self.config
        dt = F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(m.dt_min, m.dt_max)
        valid = torch.arange(dt.shape[1], device=dt.device)[None, :] < num_tokens[:, None]  # [b, l]
        return dt * valid[..., None]

    def forward(
        self, hidden: torch.Tensor, state: MambaState | None, num_tokens: torch.Tensor, in_place: bool = False
    ) -> tuple[torch.Tensor, MambaState, ScanInputs | None]:
        """hidden [b, l, d] → (out [b, l, d], state after each row's last valid token, the scan's inputs).

        `state` None: every row starts its sequence here (zero state). `in_place` (one token per row, with a
        state): update `state`'s tensors instead of allocating new ones — the decode loop's fast path, for callers
        that never need the old state again. The native kernel returns no scan inputs on those two paths (nothing
        shifts a state it did not start from).
        """
        m = self.config
        b, length, _ = hidden.shape
        in_place = in_place and length == 1 and state is not None
        if in_place and self.decode_kernel == "native":
            return self._native_decode(hidden, state), state, None
        if in_place and self.decode_kernel == "triton":
            return self._triton_decode(hidden, state), state, None
        if self.decode_kernel == "native" and state is not None and length <= NATIVE_STEPWISE_MAX_TOKENS:
            return self._native_steps(hidden, state, num_tokens)
        if self.decode_kernel == "native" and (state is None or length > NATIVE_STEPWISE_MAX_TOKENS):
            return self._native_prefill(hidden, num_tokens, state)
        # 1. Projections.
        z, conv_in, dt = self.scan_inputs(hidden, num_tokens)
        # 2. Causal conv over xBC, continuing the stored window.
        weight = self.conv1d.weight.squeeze(1)
        if in_place:
            xbc, conv_state = conv_step_(conv_in, state.conv, weight, self.conv1d.bias), state.conv
        else:
            previous = hidden.new_zeros(b, m.conv_dim, m.conv_kernel - 1) if state is None else state.conv
            xbc, conv_state = causal_conv(conv_in, previous, weight, self.conv1d.bias, num_tokens)
        x, B, C = xbc.split([m.intermediate_size, m.num_groups * m.state_size, m.num_groups * m.state_size], dim=-1)
        x = x.reshape(b, length, m.num_heads, m.head_dim)
        B = B.reshape(b, length, m.num_groups, m.state_size)
        C = C.reshape(b, length, m.num_groups, m.state_size)
        A = -torch.exp(self.A_log.float())
        # 3. SSM: the one-step recurrence for decode, chunked SSD for anything longer (or from the zero state).
        if in_place:
            step = compiled_ssm_step_() if self.decode_kernel == "compile" else ssm_step_
            y, ssm_state = step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state.ssm)[:, None], state.ssm
        elif length == 1 and state is not None:
            y, ssm_state = ssm_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state.ssm)
            y = y[:, None]
        else:
            y, ssm_state = ssd_chunked(x, dt, A, B, C, None if state is None else state.ssm, m.chunk_size)
        y = y + self.D.float()[:, None] * x.float()
        # 4. Gated norm and output projection.
        y = self.norm(y.reshape(b, length, m.intermediate_size), z, hidden.dtype)
        return self.out_proj(y), MambaState(conv_state, ssm_state), ScanInputs(conv_in, x, B, dt)

    def _kernel_step(self, proj: torch.Tensor, state: MambaState, conv_out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row (proj [b, I + conv_dim + H], contiguous) through the C kernel, updating `state` in
        place; returns the out_proj input [b, I] (and the conv output into `conv_out` when given)."""
        m = self.config
        return native_recurrent.mamba2_decode_step(
            proj,
            state.conv,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias,
            self.A_log,
            self.D,
            (m.dt_min, m.dt_max),
            state.ssm,
            self.norm.weight,
            self.norm.num_groups,
            self.norm.eps,
            m.num_groups,
            conv_out=conv_out,
        )

    def _native_decode(self, hidden: torch.Tensor, state: MambaState) -> torch.Tensor:
        """The one-token step through the C kernel (CPU, float32): conv, SSM and gated norm in one pass."""
        return self.out_proj(self._kernel_step(self.in_proj(hidden[:, 0]).contiguous(), state))[:, None]

    def _triton_decode(self, hidden: torch.Tensor, state: MambaState) -> torch.Tensor:
        """The one-token step through the Triton kernels: conv, SSM (state in place), D skip and gated norm."""
        from workers.model.kernels.triton_kernels.mamba2 import mamba2_decode_step

        m = self.config
        y = mamba2_decode_step(
            self.in_proj(hidden[:, 0]),
            state.conv,
            state.ssm,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias,
            self.A_log,
            self.D,
            (m.dt_min, m.dt_max),
            self.norm.weight,
            self.norm.num_groups,
            self.norm.eps,
            m.num_groups,
        )
        return self.out_proj(y)[:, None]

    def _native_prefill(
        self, hidden: torch.Tensor, num_tokens: torch.Tensor, state: MambaState | None = None
    ) -> tuple[torch.Tensor, MambaState, ScanInputs | None]:
        """Prompts (from the zero state: no scan inputs) or the next chunk of one (from `state`, with its scan
        inputs, as every forward from a kept state returns them) through the C kernel: conv, SSM and gated norm."""
        m = self.config
        proj = self.in_proj(hidden).contiguous()
        out, conv, ssm, xbc = native_recurrent.mamba2_prefill(
            proj,
            num_tokens.contiguous(),
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias,
            self.A_log,
            self.D,
            (m.dt_min, m.dt_max),
            self.norm.weight,
            self.norm.num_groups,
            self.norm.eps,
            m.num_heads,
            m.num_groups,
            None if state is None else (state.conv, state.ssm),
        )
        if state is None:
            return self.out_proj(out), MambaState(conv, ssm), None
        b, length, _ = hidden.shape
        _, conv_in, dt_raw = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        x = xbc[..., : m.intermediate_size].reshape(b, length, m.num_heads, m.head_dim)
        B = xbc[..., m.intermediate_size : m.intermediate_size + m.num_groups * m.state_size]
        scan = ScanInputs(conv_in, x, B.reshape(b, length, m.num_groups, m.state_size), self._dt(dt_raw, num_tokens))
        return self.out_proj(out), MambaState(conv, ssm), scan

    def _native_steps(
        self, hidden: torch.Tensor, state: MambaState, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, MambaState, ScanInputs]:
        """A few tokens per row (speculative verification, draft steps) as consecutive native decode steps on a
        scratch copy of the state; `state` itself is left as it was. Returns what `forward` returns."""
        m = self.config
        b, length, _ = hidden.shape
        proj = self.in_proj(hidden)  # [b, l, I + conv_dim + H]
        scratch = MambaState(state.conv.clone(), state.ssm.clone())
        conv_out = torch.empty(b, length, m.conv_dim)
        y = torch.empty(b, length, m.intermediate_size)
        for t in range(length):  # positions past a row's num_tokens run too; their results are never read
            xbc = torch.empty(b, m.conv_dim)
            y[:, t] = self._kernel_step(proj[:, t].contiguous(), scratch, conv_out=xbc)
            conv_out[:, t] = xbc
        _, conv_in, dt_raw = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        x = conv_out[..., : m.intermediate_size].reshape(b, length, m.num_heads, m.head_dim)
        B = conv_out[..., m.intermediate_size : m.intermediate_size + m.num_groups * m.state_size]
        scan = ScanInputs(conv_in, x, B.reshape(b, length, m.num_groups, m.state_size), self._dt(dt_raw, num_tokens))
        if bool((num_tokens == length).all()):
            new_state = scratch  # every row ran exactly its own tokens
        else:
            new_state = self.state_after(state, scan, num_tokens)
        return self.out_proj(y), new_state, scan

    def state_after(
        self, state: MambaState, scan: ScanInputs, num_tokens: torch.Tensor, static_shapes: bool = False
    ) -> MambaState:
        """The state after each row's first `num_tokens` inputs of a forward that started from `state`.

        Speculative decoding's state shifting: verification runs k+1 tokens, then keeps the state after input
        num_accepted_tokens − 1. Recomputed from the scan inputs (conv window: a gather; SSM state: one weighted
        sum), so no per-position state is ever stored. Its shapes never depend on `num_tokens`'s values
        (`static_shapes` changes nothing here).
        """
        if self.decode_kernel == "triton":
            from workers.model.kernels.triton_kernels.mamba2 import mamba2_shift_

            new = MambaState(state.conv.clone(), state.ssm.clone())
            mamba2_shift_(new.conv, new.ssm, scan.conv_in, scan.x, scan.B, scan.dt, self.A_log, num_tokens)
            return new
        valid = torch.arange(scan.dt.shape[1], device=scan.dt.device)[None, :] < num_tokens[:, None]
        dt = scan.dt * valid[..., None]
        A = -torch.exp(self.A_log.float())
        return MambaState(
            conv_window_after(state.conv, scan.conv_in, num_tokens), ssm_state_after(scan.x, dt, A, scan.B, state.ssm)
        )


def mamba2_shard_rules(mixer: Mamba2Mixer) -> dict[str, ShardRule]:
    """The cuts of a rank's Mamba2 parameters from the full ones: in_proj rows [z_r | x_r | B_r | C_r | dt_r], conv
    channels [x_r | B_r | C_r], A_log / D / dt_bias by head, the norm by channel, out_proj's input columns (its bias
    on rank 0 only). The global sizes follow from the local config and the group size."""
    m, tp = mixer.config, mixer.tp
    heads, width, n = m.num_heads, m.intermediate_size, m.state_size  # this rank's h_l, I_l
    full_width = width * tp.size
    num_groups = m.num_groups * tp.size if m.norm_span == 1 else tp.size // m.norm_span  # global g
    first_group, local_groups = mamba_groups(num_groups, tp)
    mine = (tp.rank * width, width)
    x_rows = (full_width + tp.rank * width, width)
    b_rows = (2 * full_width + first_group * n, local_groups * n)
    c_rows = (b_rows[0] + num_groups * n, local_groups * n)
    dt_rows = (2 * full_width + 2 * num_groups * n + tp.rank * heads, heads)
    projection = rows(mine, x_rows, b_rows, c_rows, dt_rows)
    conv = rows(mine, (full_width + first_group * n, local_groups * n), (c_rows[0] - full_width, c_rows[1]))
    by_head = rows((tp.rank * heads, heads))
    rules = {"in_proj.weight": projection, "conv1d.weight": conv, "out_proj.weight": columns(mine)}
    rules.update({"dt_bias": by_head, "A_log": by_head, "D": by_head})
    if mixer.in_proj.bias is not None:
        rules["in_proj.bias"] = projection
    if mixer.conv1d.bias is not None:
        rules["conv1d.bias"] = conv
    if mixer.out_proj.bias is not None:
        rules["out_proj.bias"] = ShardRule(rank0_only=True)
    if isinstance(mixer.norm, (GatedRMSNorm, SpanningGatedRMSNorm)):
        rules["norm.weight"] = rows(mine)
    return rules
