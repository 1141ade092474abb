"""The Kimi Delta Attention mixer of Kimi-Linear (its "linear_attention" layers).

in_proj → causal depthwise convs (SiLU) over q, k, v → l2norm q and k, q · d^-0.5 → the Kimi delta rule with a
decay per key channel, g = −exp(A_log) · softplus(f_b(f_a(x)) + dt_bias), and beta = sigmoid(b(x)) → per-head
gated RMSNorm (weight · rmsnorm(o) · sigmoid(g_b(g_a(x)))) → o_proj.
Our `in_proj` holds every projection of the input as one matrix with rows `[q | k | v | f_a | g_a | b]` and
`conv1d` the three short convs stacked `[q | k | v]` (the loader concatenates them). State comes in as a
`RecurrentState` (conv window [3·h·d, W-1], delta-rule state [h, d, d]) and the new one is returned.
With `decode_kernel == "native"` (CPU float32, set at load) decode steps and prompts run everything between the
projections and o_proj in C (`kernels/native_kimi.py` over `csrc/kda_decode.c`); f_b_proj and g_b_proj stay linears
on in_proj's f_a / g_a parts, as the decode plan records them. Other kernels (Triton) would dispatch beside it.
Tensor parallel (`tp`): built from the rank's local config (h/T heads); q, k, v, beta rows, the convs, f_b_proj,
g_b_proj, dt_bias and A_log are cut by head, the low-rank f_a / g_a rows stay whole on every rank, the per-head
norm is local and `o_proj` row-parallel (`forward` returns this rank's partial sum; the model all-reduces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.distributed.slices import ShardRule, rows
from workers.model.kernels import native_kimi
from workers.model.kernels.gated_delta import l2norm
from workers.model.kernels.kimi_delta import chunked_kda, kda_scan, kda_state_after, kda_step_
from workers.model.kernels.ssd import causal_conv, conv_step_, conv_window_after
from workers.model.layers.head_split import head_rows, row_parallel, share
from workers.model.state import DeltaScanInputs, RecurrentState

# Up to this many new tokens per row from a kept state (decode, speculative verification, draft steps) the delta
# rule runs token by token; longer inputs (prompts) take the chunked form, or with the native kernel the native
# prefill (csrc/kda_decode.c: conv to gated norm token by token in C) at any length from the zero state.
RECURRENT_MAX_TOKENS = 8


def _contiguous(state: RecurrentState) -> bool:
    return state.conv.is_contiguous() and state.ssm.is_contiguous()


@dataclass
class KdaKeptInputs:
    """What a native verification keeps for `state_after`: the kernels' inputs (a keep re-runs the accepted tokens
    from them with the decode step's arithmetic), batch-major like every scan input (a graph plan stores them by
    row): views of the token-major buffers the kernels wrote."""

    proj: torch.Tensor  # [b, l, 3·h·d + 2·d + h] in_proj output
    f: torch.Tensor  # [b, l, h·d] f_b_proj(f_a)


class SigmoidGatedRMSNorm(nn.Module):
    """KDA's output norm: weight · rmsnorm(y) · sigmoid(gate) over each head's channels, in float32."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, gate [..., heads, head_dim] → [..., heads, head_dim] in `out_dtype`."""
        y = y.float()
        normed = self.weight.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))
        return (normed * torch.sigmoid(gate.float())).to(out_dtype)


class KimiDeltaAttentionMixer(nn.Module):
    """Kimi Delta Attention over explicit state; `forward` has the recurrent mixer contract of
    `GatedDeltaNetMixer.forward` (scan inputs carry a per-channel g [b, l, h, d])."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the group."""
        super().__init__()
        k = config.kda
        self.config = k
        self.tp = tp
        d, width = k.head_dim, k.qkv_dim
        self.in_proj = nn.Linear(config.hidden_size, k.conv_dim + 2 * d + k.num_heads, bias=False)
        self.conv1d = nn.Conv1d(k.conv_dim, k.conv_dim, k.conv_kernel, groups=k.conv_dim, bias=False)
        self.f_b_proj = nn.Linear(d, width, bias=False)
        self.g_b_proj = nn.Linear(d, width, bias=False)
        # A_log and dt_bias are kept in float32 whatever the weight dtype (see loader).
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(k.num_heads))
        self.o_norm = SigmoidGatedRMSNorm(d, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)
        # One-token steps and state shifts: "native" (C, CPU float32; prompts too), "triton" or "torch" (set at load).
        self.decode_kernel = "torch"

    def shard_rules(self) -> dict[str, ShardRule]:
        """in_proj's `[q | k | v | f_a g_a | b]` (f_a, g_a whole) and the convs by heads, f_b / g_b rows, dt_bias
        and A_log by head, `o_proj` row-parallel."""
        if not self.tp.parallel:
            return {}
        k, tp, t = self.config, self.tp, self.tp.size
        width, low = k.qkv_dim, 2 * k.head_dim  # local q (k, v) width; f_a and g_a rows
        conv = [(width, 0), (width, t * width), (width, 2 * t * width)]
        low_rank = (3 * t * width, low)  # the same rows on every rank
        beta = share(tp, k.num_heads, 3 * t * width + low)
        by_head = head_rows(tp, (width, 0))
        return {
            "in_proj.weight": rows(*(share(tp, local, offset) for local, offset in conv), low_rank, beta),
            "conv1d.weight": head_rows(tp, *conv),
            "f_b_proj.weight": by_head,
            "g_b_proj.weight": by_head,
            "dt_bias": by_head,
            "A_log": head_rows(tp, (k.num_heads, 0)),
        } | row_parallel("o_proj", self.o_proj, share(tp, width))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [b, l, 3·h·d] → q, k (normalised, q scaled), v, each [b, l, h, d] float32."""
        k = self.config
        b, length, _ = qkv.shape
        q, key, v = (x.reshape(b, length, k.num_heads, k.head_dim) for x in qkv.float().split(k.qkv_dim, dim=-1))
        return l2norm(q) * k.head_dim**-0.5, l2norm(key), v

    def _gates(
        self, f_low: torch.Tensor, b_raw: torch.Tensor, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g = −exp(A_log) · softplus(f_b(f_a) + dt_bias) [b, l, h, d], beta = sigmoid(b) [b, l, h]), float32,
        both 0 at padding."""
        k = self.config
        b, length, _ = f_low.shape
        raw = self.f_b_proj(f_low).float() + self.dt_bias.float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(raw.view(b, length, k.num_heads, k.head_dim))
        valid = torch.arange(length, device=g.device)[None, :] < num_tokens[:, None]  # [b, l]
        return g * valid[..., None, None], b_raw.float().sigmoid() * valid[..., None]

    def forward(
        self, hidden: torch.Tensor, state: RecurrentState | None, num_tokens: torch.Tensor, in_place: bool = False
    ) -> tuple[torch.Tensor, RecurrentState, DeltaScanInputs | KdaKeptInputs | None]:
        """hidden [b, l, hidden] → (out [b, l, hidden], state after each row's last valid token, the scan's inputs).

        `state` None: every row starts its sequence here (zero state). `in_place` (with a state, one token per
        row): write the new state into `state`'s tensors and return them (the decode loop's pool views). The native
        kernels return no scan inputs for an in-place step or a prompt from the zero state (nothing shifts a state it
        did not start from).
        """
        k = self.config
        b, length, _ = hidden.shape
        if self.decode_kernel == "native":
            if in_place and length == 1 and state is not None and _contiguous(state):
                return self._native_decode(hidden, state), state, None
            if state is None or length > RECURRENT_MAX_TOKENS:
                return self._native_prefill(hidden, num_tokens, state)
            if _contiguous(state):
                return self._native_verify(hidden, state, num_tokens)
        # 1. Projections.
        conv_in, f_low, g_low, b_raw = self.in_proj(hidden).split([k.conv_dim, k.head_dim, k.head_dim, k.num_heads], -1)
        in_place = in_place and state is not None and length == 1 and state.ssm.is_contiguous()
        if in_place and self.decode_kernel == "triton":
            return self._triton_decode(conv_in[:, 0], f_low[:, 0], g_low[:, 0], b_raw[:, 0], state), state, None
        # 2. Causal convs (+ SiLU) over q, k, v, continuing the stored window.
        weight = self.conv1d.weight.squeeze(1)
        if in_place:
            qkv, conv_state = conv_step_(conv_in, state.conv, weight, None), state.conv
        else:
            previous = hidden.new_zeros(b, k.conv_dim, k.conv_kernel - 1) if state is None else state.conv
            qkv, conv_state = causal_conv(conv_in, previous, weight, None, num_tokens)
        q, key, v = self._heads(qkv)
        decay, beta = self._gates(f_low, b_raw, num_tokens)
        # 3. The delta rule: in place for decode, token by token from a kept state for a few tokens, else chunked.
        if in_place:
            delta_state = kda_step_(key[:, 0], v[:, 0], decay[:, 0], beta[:, 0], state.ssm)
            o = (q[:, 0].unsqueeze(-2) @ delta_state).transpose(1, 2)  # [b, 1, h, d]
        elif state is not None and length <= RECURRENT_MAX_TOKENS:
            o, delta_state = kda_scan(q, key, v, decay, beta, state.ssm)
        else:
            start = hidden.new_zeros(b, k.num_heads, k.head_dim, k.head_dim, dtype=torch.float32)
            o, delta_state = chunked_kda(q, key, v, decay, beta, start if state is None else state.ssm, k.chunk_size)
        # 4. Gated norm per head, output projection.
        gate = self.g_b_proj(g_low).view(b, length, k.num_heads, k.head_dim)
        y = self.o_norm(o, gate, hidden.dtype)
        out = self.o_proj(y.reshape(b, length, k.qkv_dim))
        new_state = state if in_place else RecurrentState(conv_state, delta_state)
        return out, new_state, DeltaScanInputs(conv_in, key, v, decay, beta)

    def _triton_decode(
        self,
        conv_in: torch.Tensor,
        f_low: torch.Tensor,
        g_low: torch.Tensor,
        b_raw: torch.Tensor,
        state: RecurrentState,
    ) -> torch.Tensor:
        """The one-token step through the Triton kernels (conv, gates, delta rule with the state in place, gated
        norm) from the projections [b, ...] of one token per row; returns out [b, 1, hidden]."""
        from workers.model.kernels.triton_kernels.kda import kda_decode_step

        weight, norm = self.conv1d.weight.squeeze(1), self.o_norm
        f, gate = self.f_b_proj(f_low), self.g_b_proj(g_low)
        y = kda_decode_step(
            conv_in, f, b_raw, gate, state.conv, state.ssm, weight, self.A_log, self.dt_bias, norm.weight, norm.eps
        )
        return self.o_proj(y)[:, None]

    def _native_projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj's output [..., 3·h·d + 2·d + h] (contiguous), and f = f_b_proj(f_a), gate = g_b_proj(g_a)
        [..., h·d]: the kernels' inputs, as the decode plan records them."""
        k = self.config
        proj = self.in_proj(hidden).contiguous()
        f_low, g_low = proj[..., k.conv_dim : k.conv_dim + 2 * k.head_dim].split(k.head_dim, dim=-1)
        return proj, self.f_b_proj(f_low).contiguous(), self.g_b_proj(g_low).contiguous()

    def _native_decode(self, hidden: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """One token per row through `csrc/kda_decode.c`, updating `state` in place; hidden [b, 1, hidden]."""
        proj, f, gate = self._native_projections(hidden[:, 0])
        out = native_kimi.kda_decode_step(
            proj,
            f,
            gate,
            state.conv,
            self.conv1d.weight.squeeze(1),
            self.dt_bias,
            self.A_log,
            state.ssm,
            self.o_norm.weight,
            self.o_norm.eps,
        )
        return self.o_proj(out)[:, None]

    def _native_verify(
        self, hidden: torch.Tensor, state: RecurrentState, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, RecurrentState, KdaKeptInputs]:
        """A few tokens per row from a kept state (verification, draft steps, a prompt's short last chunk) through
        `csrc/kda_decode.c`: outputs bit for bit those of decode steps, `state` left as it was, the new state the
        keep of each row's valid tokens. Returns what `forward` returns."""
        proj, f, gate = self._native_projections(hidden.transpose(0, 1))  # token-major [l, b, ·]
        weight = self.conv1d.weight.squeeze(1)
        out = native_kimi.kda_verify(
            proj, f, gate, state.conv, weight, self.dt_bias, self.A_log, state.ssm, self.o_norm.weight, self.o_norm.eps
        )
        kept = KdaKeptInputs(proj.transpose(0, 1), f.transpose(0, 1))
        return self.o_proj(out).transpose(0, 1).contiguous(), self.state_after(state, kept, num_tokens), kept

    def _native_prefill(
        self, hidden: torch.Tensor, num_tokens: torch.Tensor, state: RecurrentState | None
    ) -> tuple[torch.Tensor, RecurrentState, DeltaScanInputs | None]:
        """Prompts (from the zero state: no scan inputs) or the next chunk of one (from `state`, with its scan
        inputs, as every forward from a kept state returns them) through `csrc/kda_decode.c`. Returns what
        `forward` returns."""
        k = self.config
        b, length, _ = hidden.shape
        proj, f, gate = self._native_projections(hidden)
        out, conv, delta_state, qkv = native_kimi.kda_prefill(
            proj,
            f,
            gate,
            num_tokens.contiguous(),
            self.conv1d.weight.squeeze(1),
            self.dt_bias,
            self.A_log,
            self.o_norm.weight,
            self.o_norm.eps,
            k.num_heads,
            None if state is None else (state.conv, state.ssm),
        )
        out = self.o_proj(out)
        if state is None:
            return out, RecurrentState(conv, delta_state), None
        key, v = (x.reshape(b, length, k.num_heads, k.head_dim) for x in qkv[..., k.qkv_dim :].split(k.qkv_dim, -1))
        decay, beta = self._gates(
            proj[..., k.conv_dim : k.conv_dim + k.head_dim], proj[..., -k.num_heads :], num_tokens
        )
        scan = DeltaScanInputs(proj[..., : k.conv_dim], key, v, decay, beta)
        return out, RecurrentState(conv, delta_state), scan

    def state_after(
        self,
        state: RecurrentState,
        scan: DeltaScanInputs | KdaKeptInputs,
        num_tokens: torch.Tensor,
        static_shapes: bool = False,
    ) -> RecurrentState:
        """The state after each row's first `num_tokens` inputs of a forward that started from `state`: the conv
        window is a gather, the delta-rule state re-runs the accepted prefix (≤ k + 1 steps) from the step's start
        state over the kept k, v, g, beta (as `GatedDeltaNetMixer.state_after` does). `static_shapes`: re-run all l
        steps (those past a row's count are exact no-ops) instead of reading the largest count on the host."""
        if self.decode_kernel == "triton":
            from workers.model.kernels.triton_kernels.gdn import gdn_shift_  # g per key channel: KDA's decay

            new = RecurrentState(state.conv.clone(), state.ssm.clone())
            gdn_shift_(new.conv, new.ssm, scan.conv_in, scan.k, scan.v, scan.g, scan.beta, num_tokens)
            return new
        if isinstance(scan, KdaKeptInputs):  # from a native verification: the keep kernel, from copies
            new = RecurrentState(*(t.clone(memory_format=torch.contiguous_format) for t in (state.conv, state.ssm)))
            weight = self.conv1d.weight.squeeze(1)
            proj, f = (t.transpose(0, 1).contiguous() for t in (scan.proj, scan.f))  # token-major again (no copy)
            native_kimi.kda_keep(proj, f, new.conv, weight, self.dt_bias, self.A_log, new.ssm, num_tokens)
            return new
        num_steps = scan.k.shape[1] if static_shapes else None
        return RecurrentState(
            conv_window_after(state.conv, scan.conv_in, num_tokens),
            kda_state_after(scan.k, scan.v, scan.g, scan.beta, state.ssm, num_tokens, num_steps),
        )
