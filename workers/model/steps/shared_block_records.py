"""The records of Zamba2's shared transformer blocks in a decode plan: each use's calls, in the order
`SharedBlockUse.forward` and `HybridModel.forward` make them on the native path.

Per use (`layers/shared_block.py`): [hidden | embeddings] (COPY_ROWS of `hidden` into the left half of a 2d-wide
buffer whose right half holds the step's input embeddings, copied once after EMBED), its RMSNorm, q/k/v as the shared
projection plus the use's low-rank adapter up(down(x)) when it has one (LINEAR, LINEAR, LINEAR, ADD: torch's
`base(x) + adapter(x)`), RoPE when the config has it, attention over the use's own KV cache layer, the shared o_proj,
pre_ff_norm, gate/up (shared projection plus adapter), GELU_MUL (the kernel the module path calls), down_proj, the
use's own `linear`; then the next block's norm of hidden + T (ADD into scratch, RMS_NORM: the residual stream is
not written). The shared weights are the same modules in every use, so every use's records point at the same packed
panels. A block before a use ends with PassThroughNorm's residual, hidden += out and normed = hidden
(`lfm_olmo_records.record_residual`, as before OLMo's post-norm blocks).
"""

from __future__ import annotations

import torch

from workers.model.checkpoint.config import SHARED_ATTENTION
from workers.model.layers.linear import NativeLinear
from workers.model.layers.norm import RMSNorm
from workers.model.layers.shared_block import AdaptedLinear, SharedBlockUse
from workers.model.steps.plan_records import Op, Recorder, record_rope_attention, scratch_rows


class SharedBlockScratch:
    """Buffers for up to `tokens` rows of the shared-block uses of `model` (all empty when it has none)."""

    def __init__(self, model: torch.nn.Module, tokens: int):
        config, uses = model.config, shared_uses(model)
        if not uses:
            tokens = 0
        d, a = config.hidden_size, config.attention
        self.concat, self.concat_normed = (torch.empty(tokens, 2 * d) for _ in range(2))  # [hidden | embeddings]
        self.keys, self.values = (torch.empty(tokens, a.num_kv_heads * a.head_dim) for _ in range(2))
        rank = config.shared_block.adapter_rank if uses else 1
        widths = [
            m.out_features for use in uses for m in use.modules() if isinstance(m, torch.nn.Linear | NativeLinear)
        ]
        self.low = torch.empty(tokens * rank)  # an adapter's down projection
        self.adapted = torch.empty(tokens * max(widths, default=1))  # an adapter's output, added to the base's
        self.ffn_in, self.total = (torch.empty(tokens, d) for _ in range(2))


def shared_uses(model: torch.nn.Module) -> list[SharedBlockUse]:
    """The model's shared-block uses, in block order."""
    return [block.mixer for block in model.blocks if block.kind == SHARED_ATTENTION]


def shared_block_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the shared-block uses of `model` cannot be recorded, or None when they can (or it has none)."""
    uses = shared_uses(model)
    if not uses:
        return None
    a = model.config.attention
    if model.config.residual_multiplier != 1.0:
        return "Zamba2 with a residual multiplier is not covered (its shared blocks' residual adds run in torch)"
    if a.output_gate or a.qk_norm or a.head_gate or a.sliding_window is not None:
        return "shared blocks with gated, q/k-normed or sliding-window attention are not covered"
    for use in uses:
        norms = [use.input_norm, use.pre_ff_norm]
        if not (use.native and use.attention.native and all(norm.native for norm in norms)):
            return "Zamba2's shared blocks do not run through the native kernels"
        adapted = [use.attention.q_proj, use.attention.k_proj, use.attention.v_proj, use.gate_up_proj]
        adapters = [layer.adapter for layer in adapted if layer.adapter is not None]
        linears = [use.linear, use.down_proj, use.attention.o_proj, *(layer.base for layer in adapted)]
        if not all(
            isinstance(m, NativeLinear) for m in [*linears, *(a.down for a in adapters), *(a.up for a in adapters)]
        ):
            return "a Zamba2 shared block has linears outside the native kernel"
    return None


def record_embeddings_copy(rec: Recorder, plan: object, n: int) -> None:
    """After EMBED: the input embeddings into the right half of [hidden | embeddings], where every use reads them
    (the module path's `embeddings = hidden.clone()`). Nothing for a model without shared blocks."""
    scratch = plan.shared_scratch
    if scratch.concat.shape[0]:
        d = plan.model.config.hidden_size
        rec.emit(Op.COPY_ROWS, [scratch.concat.view(-1)[d:], plan.hidden, n, d, 2 * d, d])


def record_shared_block(rec: Recorder, plan: object, use: SharedBlockUse, layer: int, next_norm: RMSNorm) -> None:
    """One use's records over all rows · length tokens: T into `plan.mixed`, next_norm(hidden + T) into
    `plan.normed`; `layer` is the use's KV cache layer."""
    s, n, d = plan.shared_scratch, rec.rows * rec.length, plan.model.config.hidden_size
    a = use.attention.config
    # 1. x2 = input_norm([hidden | embeddings]).
    rec.emit(Op.COPY_ROWS, [s.concat, plan.hidden, n, d, 2 * d, d])
    x2 = s.concat_normed[:n]
    rec.emit(Op.RMS_NORM, [s.concat[:n], use.input_norm.weight, x2, n, 2 * d], (use.input_norm.eps,))
    # 2. Attention over this use's cache: q/k/v = shared W·x2 (+ the use's adapter), its output through o_proj.
    q = scratch_rows(plan.wide, n, a.num_heads * a.head_dim)
    keys, values = s.keys[:n], s.values[:n]
    for projection, out in ((use.attention.q_proj, q), (use.attention.k_proj, keys), (use.attention.v_proj, values)):
        _record_adapted(rec, projection, x2, out, s)
    attended = scratch_rows(plan.narrow, n, a.num_heads * a.head_dim)
    record_rope_attention(rec, plan, a, layer, q, keys, values, attended)
    rec.linear(use.attention.o_proj, attended, plan.mixed[:n])
    # 3. The gated-GELU MLP on pre_ff_norm(attention output), then the use's own projection.
    eps = use.pre_ff_norm.eps
    rec.emit(Op.RMS_NORM, [plan.mixed[:n], use.pre_ff_norm.weight, s.ffn_in[:n], n, d], (eps,))
    inner = use.down_proj.in_features
    gate_up = scratch_rows(plan.wide, n, 2 * inner)
    _record_adapted(rec, use.gate_up_proj, s.ffn_in[:n], gate_up, s)
    activated = scratch_rows(plan.narrow, n, inner)
    rec.emit(Op.GELU_MUL, [gate_up, activated, n, inner])
    rec.linear(use.down_proj, activated, s.ffn_in[:n])
    rec.linear(use.linear, s.ffn_in[:n], plan.mixed[:n])
    # 4. The next block reads norm(hidden + T); its residual stays `hidden`.
    rec.emit(Op.ADD, [plan.hidden, plan.mixed, s.total, n * d])
    rec.emit(Op.RMS_NORM, [s.total[:n], next_norm.weight, plan.normed[:n], n, d], (next_norm.eps,))


def _record_adapted(
    rec: Recorder, layer: AdaptedLinear, x: torch.Tensor, out: torch.Tensor, s: SharedBlockScratch
) -> None:
    """out = base(x) (+ adapter(x)): the shared projection, then the use's up(down(x)) added as torch adds it."""
    n = x.shape[0]
    rec.linear(layer.base, x, out)
    if layer.adapter is None:
        return
    low = scratch_rows(s.low, n, layer.adapter.down.out_features)
    adapted = scratch_rows(s.adapted, n, layer.base.out_features)
    rec.linear(layer.adapter.down, x, low)
    rec.linear(layer.adapter.up, low, adapted)
    rec.emit(Op.ADD, [out, adapted, out, out.numel()])
