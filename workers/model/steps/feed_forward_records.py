"""The records of a feed-forward block, shared by the decode plan and the MTP plan: a dense MLP, and a MoE block as
the calls `MoE.forward` makes on the native path — the router's panels, `moe_route`, the latent projection
(Nemotron-H), `moe_experts`, the shared MLP and its gate, `moe_combine` — so plan and module agree bit for bit."""

from __future__ import annotations

import torch

from workers.model.kernels import native_moe
from workers.model.layers.feed_forward import MLP
from workers.model.layers.moe import MoE
from workers.model.steps.plan_records import Op, Recorder, linear_record, scratch_rows


class MoeScratch:
    """Buffers for up to `tokens` rows of the MoE blocks in `moes`: router logits, routing weights and ids, the
    latent inputs, the experts' sums, the latent outputs, the shared MLP's output and its gate."""

    def __init__(self, moes: list[MoE], tokens: int, hidden_size: int):
        widest = lambda values: max(values, default=1)  # noqa: E731
        ffs = [moe.router.ff for moe in moes]
        self.logits = torch.empty(tokens * widest(ff.num_experts for ff in ffs))
        self.weights = torch.empty(tokens * widest(ff.experts_per_token for ff in ffs))
        self.ids = torch.zeros(tokens * widest(ff.experts_per_token for ff in ffs), dtype=torch.int64)
        self.latent = torch.empty(tokens * widest(ff.latent_size or 1 for ff in ffs))
        self.experts_out = torch.empty(tokens * widest([*(ff.latent_size or 1 for ff in ffs), hidden_size]))
        self.routed, self.shared = (torch.empty(tokens * hidden_size if moes else 0) for _ in range(2))
        self.gate = torch.empty(tokens if moes else 0)


def record_mlp(
    rec: Recorder, mlp: MLP, x: torch.Tensor, out: torch.Tensor, wide: torch.Tensor, narrow: torch.Tensor
) -> None:
    """out [n, d] = mlp(x [n, d]): up projection into `wide`, the activation into `narrow`, down projection."""
    n, intermediate = x.shape[0], mlp.down_proj.in_features
    h = scratch_rows(wide, n, mlp.up_proj.out_features)
    act = scratch_rows(narrow, n, intermediate)
    rec.emit(*linear_record(mlp.up_proj, x, h, n))
    if mlp.gated:
        rec.emit(Op.SILU_MUL, [h, act, n, intermediate])
    else:
        rec.emit(Op.RELU_SQUARE, [h, act, n * intermediate])
    rec.emit(*linear_record(mlp.down_proj, act, out, n))


def record_moe(
    rec: Recorder,
    moe: MoE,
    x: torch.Tensor,
    out: torch.Tensor,
    scratch: MoeScratch,
    wide: torch.Tensor,
    narrow: torch.Tensor,
) -> None:
    """out [n, d] = moe(x [n, d]) as `MoE.forward` computes it on the native path."""
    n, d = x.shape
    ff, packed = moe.router.ff, moe.packed
    num_experts, k = ff.num_experts, ff.experts_per_token
    logits, weights = scratch_rows(scratch.logits, n, num_experts), scratch_rows(scratch.weights, n, k)
    ids = scratch.ids[: n * k].view(n, k)
    rec.emit(Op.LINEAR, [x, moe.router.panels, None, logits, n, num_experts, d])
    rec.emit(
        Op.MOE_ROUTE,
        [
            logits,
            weights,
            ids,
            n,
            num_experts,
            k,
            native_moe.ROUTERS[ff.router],
            int(ff.norm_topk_prob),
            ff.num_expert_groups,
            ff.topk_groups,
            moe.router.bias,
        ],
        (ff.routed_scaling_factor, ff.topk_norm_eps),
    )
    inputs = x
    if moe.latent_in is not None:
        inputs = scratch_rows(scratch.latent, n, moe.latent_in.out_features)
        rec.emit(*linear_record(moe.latent_in, x, inputs, n))
    last = moe.latent_out is None and moe.shared is None
    experts_out = out if last else scratch_rows(scratch.experts_out, n, packed.width)
    rec.emit(Op.MOE_EXPERTS, native_moe.experts_arguments(inputs, weights, ids, experts_out, packed))
    routed = experts_out
    if moe.latent_out is not None:
        routed = out if moe.shared is None else scratch_rows(scratch.routed, n, d)
        rec.emit(*linear_record(moe.latent_out, experts_out, routed, n))
    if moe.shared is None:
        return
    shared = scratch_rows(scratch.shared, n, d)
    record_mlp(rec, moe.shared, x, shared, wide, narrow)
    gate = None
    if moe.shared_gate is not None:
        gate = scratch.gate[:n]
        rec.emit(*linear_record(moe.shared_gate, x, gate.view(n, 1), n))
    rec.emit(Op.MOE_COMBINE, [routed, shared, gate, out, n, d])


def moe_unsupported_reason(moe: MoE) -> str | None:
    """Why a MoE block cannot be recorded, or None when it can."""
    if moe.packed is None:
        return "MoE experts are not packed for the native kernels (linear_backend is not native)"
    if moe.shared is not None and not moe.shared.native:
        return "the shared MLP's activation does not run through the native kernels"
    return None
