"""LFM2's gated short convolution (the "conv" layers of LFM2, LFM2-MoE and LFM3).

in_proj → B, C, x (each d wide, in that order); u = B · x through a depthwise causal conv of W taps (no activation);
C · that; out_proj. The recurrent state is the conv window of u alone ([b, d, W-1]); the `RecurrentState`'s matrix
state is empty ([b, 0, 0, 0]), so the state pools, slot moves and snapshots of the other recurrent kinds carry it
unchanged. Speculative state shifting keeps each verification's conv inputs and gathers the window after input
num_accepted − 1 (`conv_window_after`). With `decode_kernel == "native"` (CPU float32) the decode step and the
multi-token forwards run `csrc/short_conv.c` (the decode plan's kernels); the torch kernels are the reference.

Tensor parallel (built from a rank's local config, `short_conv.channels` c = d/T): the rank holds channels
`[r·c, +c)` of B, C, x and the conv; out_proj is row-parallel, its output a partial sum the model all-reduces (its
bias on rank 0 only). Every channel is independent of the others, so no collective runs inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule, columns, rows
from workers.model.kernels.short_conv import (
    native_short_conv_prefill,
    native_short_conv_step_,
    short_conv,
    short_conv_step_,
)
from workers.model.kernels.ssd import conv_window_after
from workers.model.state import RecurrentState


@dataclass
class ConvScanInputs:
    """What one short-conv layer computed from its input tokens: enough to rebuild its window after any prefix."""

    conv_in: torch.Tensor  # [b, l, d] inputs of the causal conv (B · x)


class ShortConvMixer(nn.Module):
    """The gated short convolution over explicit state; `forward` has the same contract as `Mamba2Mixer.forward`."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the tensor-parallel group."""
        super().__init__()
        c, d = config.short_conv, config.hidden_size
        width = c.channels or d  # this rank's channels
        self.tp = tp
        self.in_proj = nn.Linear(d, 3 * width, bias=c.bias)
        self.conv1d = nn.Conv1d(width, width, c.conv_kernel, groups=width, bias=c.bias)
        self.out_proj = nn.Linear(width, d, bias=c.bias)
        # One-token steps and state shifts: "native" (`csrc/short_conv.c`, CPU float32), "triton" or "torch" (set at
        # load by the loader).
        self.decode_kernel = "torch"

    def shard_rules(self) -> dict[str, ShardRule]:
        """How each parameter of this rank is cut from the unsplit mixer's (the layout in the module docstring)."""
        width = self.conv1d.weight.shape[0]
        full = width * self.tp.size
        mine = (self.tp.rank * width, width)
        projection = rows(*((third * full + mine[0], width) for third in range(3)))  # B | C | x
        rules = {"in_proj.weight": projection, "conv1d.weight": rows(mine), "out_proj.weight": columns(mine)}
        if self.in_proj.bias is not None:
            rules.update({"in_proj.bias": projection, "conv1d.bias": rows(mine)})
            rules["out_proj.bias"] = ShardRule(rank0_only=True)
        return rules

    def forward(
        self, hidden: torch.Tensor, state: RecurrentState | None, num_tokens: torch.Tensor, in_place: bool = False
    ) -> tuple[torch.Tensor, RecurrentState, ConvScanInputs | None]:
        """hidden [b, l, d] → (out [b, l, d], state after each row's last valid token, the conv's inputs).

        `state` None: every row starts its sequence here (zero window). `in_place` (one token per row, with a
        state): shift `state`'s window where it is and return it (no scan inputs: nothing shifts a decode step).
        """
        b, length, _ = hidden.shape
        native_step = in_place and state is not None and length == 1 and state.conv.is_contiguous()
        if self.decode_kernel == "native" and native_step:
            return self._native_decode(hidden, state), state, None
        if self.decode_kernel == "native" and not (in_place and state is not None and length == 1):
            return self._native_prefill(hidden, state, num_tokens)
        if self.decode_kernel == "triton" and in_place and state is not None and length == 1:
            return self._triton_decode(hidden, state), state, None
        # 1. Projections: B, C, x; the conv reads u = B · x.
        gate_b, gate_c, x = self.in_proj(hidden).chunk(3, dim=-1)
        u = gate_b * x
        weight = self.conv1d.weight.squeeze(1)  # [d, W]
        # 2. The causal conv, continuing the stored window (in place for decode steps).
        if in_place and state is not None and length == 1:
            return self.out_proj(gate_c * short_conv_step_(u, state.conv, weight, self.conv1d.bias)), state, None
        if state is None:
            window = hidden.new_zeros(b, weight.shape[0], weight.shape[1] - 1)
            matrix = hidden.new_zeros(b, 0, 0, 0, dtype=torch.float32)
        else:
            window, matrix = state.conv, state.ssm
        conv, new_window = short_conv(u, window, weight, self.conv1d.bias, num_tokens)
        # 3. Output gate C, output projection.
        return self.out_proj(gate_c * conv), RecurrentState(new_window, matrix), ConvScanInputs(u)

    def _native_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """One token per row through `csrc/short_conv.c`, shifting `state`'s window in place; hidden [b, 1, d]."""
        weight = self.conv1d.weight.squeeze(1)
        y = native_short_conv_step_(self.in_proj(hidden[:, 0]).contiguous(), state.conv, weight, self.conv1d.bias)
        return self.out_proj(y)[:, None]

    def _native_prefill(
        self, hidden: torch.Tensor, state: RecurrentState | None, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, RecurrentState, ConvScanInputs]:
        """Prompts, chunks of them or verifications through `csrc/short_conv.c` (`state` is left as it was);
        returns what `forward` returns."""
        b = hidden.shape[0]
        window = None if state is None else state.conv
        y, new_window, u = native_short_conv_prefill(
            self.in_proj(hidden), num_tokens.contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, window
        )
        matrix = hidden.new_zeros(b, 0, 0, 0, dtype=torch.float32) if state is None else state.ssm
        return self.out_proj(y), RecurrentState(new_window, matrix), ConvScanInputs(u)

    def _triton_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """One token per row through the Triton step, shifting `state`'s window in place; hidden [b, 1, d]."""
        from workers.model.kernels.triton_kernels.short_conv import short_conv_decode_step

        weight = self.conv1d.weight.squeeze(1)
        y = short_conv_decode_step(self.in_proj(hidden[:, 0]), state.conv, weight, self.conv1d.bias)
        return self.out_proj(y)[:, None]

    def state_after(
        self, state: RecurrentState, scan: ConvScanInputs, num_tokens: torch.Tensor, static_shapes: bool = False
    ) -> RecurrentState:
        """The state after each row's first `num_tokens` inputs of a forward that started from `state`: the window
        ending at input num_tokens − 1 (a gather; the same with `static_shapes`, nothing is read on the host)."""
        if self.decode_kernel == "triton":
            from workers.model.kernels.triton_kernels.common import conv_shift_

            window = state.conv.clone()
            conv_shift_(window, scan.conv_in, num_tokens)
            return RecurrentState(window, state.ssm)
        return RecurrentState(conv_window_after(state.conv, scan.conv_in, num_tokens), state.ssm)
