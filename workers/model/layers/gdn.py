"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5 (the "linear_attention" layers).

in_proj → causal depthwise conv (SiLU) over q, k, v → l2norm q and k, q · d_k^-0.5, key heads repeated to the
value heads → gated delta rule (g, beta in float32) → per-head gated RMSNorm (weight · norm(o) · silu(z)) → out_proj.
Our `in_proj` holds the checkpoint's projections as one matrix with rows `[q | k | v | z | b | a]` (the loader
de-interleaves Qwen3-Next's per-key-head groups). State comes in as a `RecurrentState` (conv window, delta-rule
state [h_v, d_k, d_v]) and the new one is returned.

Tensor parallel (`tp`): built from the rank's local config, the rank holds hk/T key heads and hv/T value heads,
contiguous, so each value head's key head is on its rank; every piece of `in_proj` and of the conv is cut by head,
A_log and dt_bias by value head, the per-head gated norm stays whole, and `out_proj` is row-parallel (`forward`
returns this rank's partial sum, which the model all-reduces). The states are the rank's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule
from workers.model.kernels import native_recurrent
from workers.model.kernels.gated_delta import (
    chunked_delta_rule,
    delta_rule_scan,
    delta_rule_step_,
    delta_state_after,
    l2norm,
)
from workers.model.kernels.ssd import causal_conv, conv_step_, conv_window_after
from workers.model.layers.head_split import head_rows, row_parallel, share
from workers.model.layers.norm import HeadGatedRMSNorm
from workers.model.state import DeltaScanInputs, RecurrentState

# Up to this many new tokens per row from a kept state (decode, speculative verification, draft steps) the delta
# rule runs token by token; longer inputs (prompts) take the chunked form, or with the native kernel the native
# prefill, at any length from the zero state (conv to gated norm token by token in C: ~4× faster than the chunked
# PyTorch path on one core at gdn-bench shapes, 10 vs 43 ms for a 512-token prompt; the whole mixer 2×).
RECURRENT_MAX_TOKENS = 8


def _contiguous(state: RecurrentState) -> bool:
    return state.conv.is_contiguous() and state.ssm.is_contiguous()


class GatedDeltaNetMixer(nn.Module):
    """Gated DeltaNet over explicit state; `forward` has the same contract as `Mamba2Mixer.forward`."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the group."""
        super().__init__()
        g = config.gdn
        self.config = g
        self.tp = tp
        self.in_proj = nn.Linear(config.hidden_size, g.conv_dim + g.value_dim + 2 * g.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(g.conv_dim, g.conv_dim, g.conv_kernel, groups=g.conv_dim, bias=False)
        # A_log and dt_bias are kept in float32 whatever the weight dtype (see loader).
        self.dt_bias = nn.Parameter(torch.zeros(g.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(g.num_value_heads))
        self.norm = HeadGatedRMSNorm(g.value_head_dim, config.rms_norm_eps if g.norm_eps is None else g.norm_eps)
        self.out_proj = nn.Linear(g.value_dim, config.hidden_size, bias=False)
        self.decode_kernel = "torch"  # one-token steps: "torch", "native" (C, CPU) or "triton" (set at load)

    def shard_rules(self) -> dict[str, ShardRule]:
        """in_proj's `[q | k | v | z | b | a]` and the conv's `[q | k | v]` by heads, A_log and dt_bias by value
        head, `out_proj` row-parallel."""
        if not self.tp.parallel:
            return {}
        g, tp, t = self.config, self.tp, self.tp.size
        key, value, heads = g.key_dim, g.value_dim, g.num_value_heads  # local widths; the full ones are t times
        conv = [(key, 0), (key, t * key), (value, 2 * t * key)]
        gates = [(heads, t * (2 * key + 2 * value)), (heads, t * (2 * key + 2 * value + heads))]
        return {
            "in_proj.weight": head_rows(tp, *conv, (value, t * (2 * key + value)), *gates),
            "conv1d.weight": head_rows(tp, *conv),
            "dt_bias": head_rows(tp, (heads, 0)),
            "A_log": head_rows(tp, (heads, 0)),
        } | row_parallel("out_proj", self.out_proj, share(tp, value))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [b, l, conv_dim] → q, k [b, l, h_v, d_k] (normalised, q scaled), v [b, l, h_v, d_v]; float32."""
        g = self.config
        b, length, _ = qkv.shape
        q, k, v = qkv.float().split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        q = l2norm(q.reshape(b, length, g.num_key_heads, g.key_head_dim)) * g.key_head_dim**-0.5
        k = l2norm(k.reshape(b, length, g.num_key_heads, g.key_head_dim))
        repeats = g.num_value_heads // g.num_key_heads
        if repeats > 1:  # value head j reads key head j // repeats (repeat_interleave, not tiling)
            q, k = q.repeat_interleave(repeats, dim=2), k.repeat_interleave(repeats, dim=2)
        return q, k, v.reshape(b, length, g.num_value_heads, g.value_head_dim)

    def _gates(
        self, b_raw: torch.Tensor, a_raw: torch.Tensor, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g = −exp(A_log) · softplus(a + dt_bias), beta = beta_scale · sigmoid(b)), [b, l, h_v] float32, both 0
        at padding. beta_scale is 2 for OLMo-Hybrid's negative eigenvalues (`linear_allow_neg_eigval`), else 1."""
        g = -self.A_log.float().exp() * F.softplus(a_raw.float() + self.dt_bias.float())
        valid = (torch.arange(g.shape[1], device=g.device)[None, :] < num_tokens[:, None])[..., None]  # [b, l, 1]
        beta = b_raw.float().sigmoid()
        if self.config.beta_scale != 1.0:
            beta = beta * self.config.beta_scale
        return g * valid, beta * valid

    def forward(
        self, hidden: torch.Tensor, state: RecurrentState | None, num_tokens: torch.Tensor, in_place: bool = False
    ) -> tuple[torch.Tensor, RecurrentState, DeltaScanInputs | None]:
        """hidden [b, l, d] → (out [b, l, d], state after each row's last valid token, the scan's inputs).

        `state` None: every row starts its sequence here (zero state). `in_place` (with a state): write the new
        state into `state`'s tensors and return them — the decode loop updates its pool views this way (the native
        and Triton kernels return no scan inputs there: nothing shifts a state it did not start from).
        """
        g = self.config
        b, length, _ = hidden.shape
        if self.decode_kernel == "native" and in_place and length == 1 and state is not None and _contiguous(state):
            return self._native_decode(hidden, state), state, None
        if self.decode_kernel == "native" and (state is None or length > RECURRENT_MAX_TOKENS):
            return self._native_prefill(hidden, num_tokens, state)
        # 1. Projections.
        conv_in, z, b_raw, a_raw = self.in_proj(hidden).split(
            [g.conv_dim, g.value_dim, g.num_value_heads, g.num_value_heads], dim=-1
        )
        in_place = in_place and state is not None and length == 1 and state.ssm.is_contiguous()
        if in_place and self.decode_kernel == "triton":
            return self._triton_decode(hidden, state), state, None
        # 2. Causal conv (+ SiLU) over q, k, v, continuing the stored window.
        weight = self.conv1d.weight.squeeze(1)
        if in_place:  # the decode loop: window and state are updated where they are
            qkv, conv_state = conv_step_(conv_in, state.conv, weight, None), state.conv
        else:
            previous = hidden.new_zeros(b, g.conv_dim, g.conv_kernel - 1) if state is None else state.conv
            qkv, conv_state = causal_conv(conv_in, previous, weight, None, num_tokens)
        q, k, v = self._heads(qkv)
        decay, beta = self._gates(b_raw, a_raw, num_tokens)
        # 3. The delta rule: in place for decode, token by token from a kept state for a few tokens, else chunked.
        if in_place:
            delta_state = delta_rule_step_(k[:, 0], v[:, 0], decay[:, 0], beta[:, 0], state.ssm)
            o = (q[:, 0].unsqueeze(-2) @ delta_state).transpose(1, 2)  # [b, 1, h_v, d_v]
        elif state is not None and length <= RECURRENT_MAX_TOKENS:
            o, delta_state = delta_rule_scan(q, k, v, decay, beta, state.ssm)
        else:
            start = hidden.new_zeros(b, g.num_value_heads, g.key_head_dim, g.value_head_dim, dtype=torch.float32)
            start = start if state is None else state.ssm
            o, delta_state = chunked_delta_rule(q, k, v, decay, beta, start, g.chunk_size)
        # 4. Gated norm per head, output projection.
        y = self.norm(o, z.reshape(b, length, g.num_value_heads, g.value_head_dim), hidden.dtype)
        out = self.out_proj(y.reshape(b, length, g.value_dim))
        new_state = state if in_place else RecurrentState(conv_state, delta_state)
        return out, new_state, DeltaScanInputs(conv_in, k, v, decay, beta)

    def _native_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """One token per row through `csrc/gdn_decode.c`, updating `state` in place; hidden [b, 1, d]."""
        g = self.config
        out = native_recurrent.gdn_decode_step(
            self.in_proj(hidden[:, 0]).contiguous(),
            state.conv,
            self.conv1d.weight.squeeze(1),
            self.dt_bias,
            self.A_log,
            state.ssm,
            self.norm.weight,
            self.norm.eps,
            g.num_key_heads,
            g.beta_scale,
        )
        return self.out_proj(out)[:, None]

    def _native_prefill(
        self, hidden: torch.Tensor, num_tokens: torch.Tensor, state: RecurrentState | None
    ) -> tuple[torch.Tensor, RecurrentState, DeltaScanInputs | None]:
        """Prompts (from the zero state: no scan inputs) or the next chunk of one (from `state`, with its scan
        inputs, as every forward from a kept state returns them) through `csrc/gdn_decode.c`: conv, delta rule
        token by token and gated norm. Returns what `forward` returns."""
        g = self.config
        b, length, _ = hidden.shape
        proj = self.in_proj(hidden).contiguous()  # [b, l, conv_dim + value_dim + 2 h_v]
        out, conv, delta_state, qkv = native_recurrent.gdn_prefill(
            proj,
            num_tokens.contiguous(),
            self.conv1d.weight.squeeze(1),
            self.dt_bias,
            self.A_log,
            self.norm.weight,
            self.norm.eps,
            g.num_key_heads,
            g.num_value_heads,
            None if state is None else (state.conv, state.ssm),
            g.beta_scale,
        )
        out = self.out_proj(out)
        if state is None:
            return out, RecurrentState(conv, delta_state), None
        conv_in, _, b_raw, a_raw = proj.split([g.conv_dim, g.value_dim, g.num_value_heads, g.num_value_heads], dim=-1)
        k = qkv[..., g.key_dim : 2 * g.key_dim].reshape(b, length, g.num_key_heads, g.key_head_dim)
        k = k.repeat_interleave(g.num_value_heads // g.num_key_heads, dim=2)  # value head j reads key head j // r
        v = qkv[..., 2 * g.key_dim :].reshape(b, length, g.num_value_heads, g.value_head_dim)
        decay, beta = self._gates(b_raw, a_raw, num_tokens)
        return out, RecurrentState(conv, delta_state), DeltaScanInputs(conv_in, k, v, decay, beta)

    def _triton_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """The one-token step through the Triton kernels: conv, gates, delta rule (state in place), gated norm."""
        from workers.model.kernels.triton_kernels.gdn import gdn_decode_step

        g = self.config
        y = gdn_decode_step(
            self.in_proj(hidden[:, 0]),
            state.conv,
            state.ssm,
            self.conv1d.weight.squeeze(1),
            self.A_log,
            self.dt_bias,
            self.norm.weight,
            self.norm.eps,
            g.num_key_heads,
            g.beta_scale,
        )
        return self.out_proj(y)[:, None]

    def state_after(
        self, state: RecurrentState, scan: DeltaScanInputs, num_tokens: torch.Tensor, static_shapes: bool = False
    ) -> RecurrentState:
        """The state after each row's first `num_tokens` inputs of a forward that started from `state`.

        Speculative state shifting for a recurrence that is not diagonal: the conv window is a gather, the delta-rule
        state re-runs the accepted prefix (≤ k + 1 steps) from the step's start state over the kept k, v, g, beta.
        That keeps only the small per-token inputs (conv inputs, k, v, g, beta) instead of one [h_v, d_k, d_v] state
        per verified position, at the price of re-running ≤ k + 1 recurrence steps. Measured with Qwen3.5-0.8B GDN
        shapes (h_v 16, d_k = d_v 128; k = 4; 2 shared CPU cores, noisy): per request and GDN layer the state is
        1 MiB; per-position states would hold 5 MiB, the re-run keeps 0.2 MiB of scan inputs for the step. The
        re-run cost 20–23% of the verification forward of a 3-GDN + 1-attention-layer stack (batch 1 and 8);
        merely copying per-position states cost 3% (batch 1) to 27% (batch 8) of it, before any bookkeeping.
        `static_shapes`: re-run all l steps (those past a row's count are exact no-ops) instead of reading the
        largest count on the host — the form a CUDA graph captures, with the same states.
        """
        if self.decode_kernel == "triton":
            from workers.model.kernels.triton_kernels.gdn import gdn_shift_

            new = RecurrentState(state.conv.clone(), state.ssm.clone())
            gdn_shift_(new.conv, new.ssm, scan.conv_in, scan.k, scan.v, scan.g, scan.beta, num_tokens)
            return new
        return RecurrentState(
            conv_window_after(state.conv, scan.conv_in, num_tokens),
            delta_state_after(
                scan.k, scan.v, scan.g, scan.beta, state.ssm, num_tokens, scan.k.shape[1] if static_shapes else None
            ),
        )
