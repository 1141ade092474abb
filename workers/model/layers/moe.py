"""Mixture-of-experts blocks: a router, routed experts and an optional always-on shared MLP.

Three paths compute the same block:
- native (CPU, set at load by `pack`): the experts packed like every linear (float32, int8 or bfloat16 panels);
  routing, the chosen experts and the sum over each token's experts in C (`kernels/native_moe.py`) — the calls
  the decode plans record, so plan and module give the same bits;
- eager PyTorch (CPU, or a GPU without grouped GEMMs): tokens sorted by expert, one pair of matmuls per used
  expert (reads which experts are used on the host);
- static (`static_shapes=True`, what a CUDA graph captures): the same sort done on the device — counts by
  `scatter_add_`, a stable `argsort`, offsets by `cumsum` — and the experts as grouped GEMMs (`torch._grouped_mm`)
  over the sorted rows: no host sync and no shape that depends on the routing. On CUDA it runs eager steps too.
Every path sums a token's experts in slot order, so a row's output does not depend on the rows beside it.
Routing breaks ties toward the lower expert (and group) index on every path.

Tensor parallel (`tp`, built from the rank's local config), two ways, both returning this rank's partial sum that
the model all-reduces once:
- inside the experts (default): every rank holds every expert's share of the intermediate width
  (`experts_up [E, 2·I_e/T, w]` = gate_r | up_r rows, `experts_down [E, w, I_e/T]`);
- expert parallel (`tp.expert_parallel`): rank r holds `local_experts(E, tp)` whole. The router is whole on every
  rank, and the hidden states are the same bits there, so every rank picks the same experts; only the (token, slot)
  pairs whose expert is local run (the others: id -1 on the native and eager paths, on the static one the id one
  past the last local expert, which no GEMM computes, and weight 0), summed in slot order. A row's partial depends
  only on its own routing, never on the batch.
The router, its score bias and the shared gate are whole on every rank; the shared MLP is split like an MLP;
Nemotron-H's latent_in / latent_out are whole, latent_out applied to the partial (it is linear; its bias rank 0's).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.checkpoint.config import FeedForwardConfig, HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, local_experts
from workers.model.distributed.slices import ShardRule, rows
from workers.model.kernels import native, native_moe, triton_kernels
from workers.model.layers.feed_forward import MLP, activate
from workers.model.layers.head_split import RANK0_ONLY, share

grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def grouped_gemm_fits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs a MoE step's experts here: bfloat16 on CUDA compute capability ≥ 8.0; any
    float dtype but float64 on CPU (where graphs are never captured: the form runs eagerly, for tests)."""
    if device.type != "cuda":
        return dtype != torch.float64
    return dtype == torch.bfloat16 and _compute_capability(device) >= (8, 0)


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once: eager CUDA steps check it in every MoE block."""
    return torch.cuda.get_device_capability(device)


def static_form_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a MoE step cannot run in static shapes here, or None: grouped GEMMs where `torch._grouped_mm` runs, else
    the Triton grouped GEMM (`kernels/triton_kernels/moe.py`) where Triton runs."""
    if grouped_gemm_fits(device, dtype):
        return None
    reason = triton_kernels.unavailable_reason(device)
    if reason is None:
        return None
    return (
        f"MoE experts in a graph run as grouped GEMMs: torch._grouped_mm takes bfloat16 on GPUs of compute "
        f"capability 8.0 or newer (not {dtype} here), and the Triton fallback cannot run ({reason})"
    )


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the last dimension, largest first, the lower index first among equals (a stable sort:
    `topk` leaves the order of ties unspecified)."""
    sorted_values, indices = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[..., :k], indices[..., :k]


def route(logits: torch.Tensor, ff: FeedForwardConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [t, E] (float32) → (weights [t, k] float32, expert ids [t, k]) for the family's router.

    "softmax": the top k of a softmax over all experts, or (`norm_topk_prob`) a softmax over the top k logits.
    "sigmoid": sigmoid scores; the experts are chosen on scores + `bias` within the best `topk_groups` groups (a
    group scores the sum of its two best), weighted by their plain scores (renormalised with `norm_topk_prob`),
    times `routed_scaling_factor`."""
    k = ff.experts_per_token
    if ff.router == "softmax":
        if not ff.norm_topk_prob:
            probs = torch.softmax(logits, dim=-1)
            return top_k(probs, k)
        top_logits, ids = top_k(logits, k)
        return torch.softmax(top_logits, dim=-1), ids
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if ff.num_expert_groups > 1:
        grouped = choice.view(-1, ff.num_expert_groups, ff.num_experts // ff.num_expert_groups)
        best = top_k(grouped, min(2, grouped.shape[-1]))[0]
        group_ids = top_k(best[..., 0] + best[..., 1] if best.shape[-1] == 2 else best[..., 0], ff.topk_groups)[1]
        keep = torch.zeros_like(grouped[..., 0]).scatter_(1, group_ids, 1.0).bool()
        choice = grouped.masked_fill(~keep[..., None], -torch.inf).view_as(choice)
    ids = top_k(choice, k)[1]
    weights = scores.gather(1, ids)
    if ff.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + ff.topk_norm_eps)
    return weights * ff.routed_scaling_factor, ids


class Router(nn.Module):
    """The router's weight [E, d] (and Nemotron-H / Kimi / LFM2's score-correction bias); `panels` once packed."""

    def __init__(self, hidden_size: int, ff: FeedForwardConfig):
        super().__init__()
        self.ff = ff
        self.weight = nn.Parameter(torch.zeros(ff.num_experts, hidden_size))
        if ff.router == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(ff.num_experts), requires_grad=False)
        self.panels: torch.Tensor | None = None  # float32 panels of the weight on the native path

    @property
    def bias(self) -> torch.Tensor | None:
        """The score-correction bias (sigmoid routers), else None."""
        return getattr(self, "e_score_correction_bias", None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [t, d] → router logits [t, E] in float32 (sigmoid routers multiply in float32 too)."""
        if self.panels is not None:
            return native.linear(hidden, self.panels, None, self.ff.num_experts)
        if self.ff.router == "sigmoid":
            return F.linear(hidden.float(), self.weight.float())
        return F.linear(hidden, self.weight).float()

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [t, d] → (weights [t, k] float32, expert ids [t, k] int64)."""
        logits = self.logits(hidden)
        if self.panels is not None:
            return native_moe.route(logits, self.ff, self.bias)
        return route(logits, self.ff, self.bias)


class MoE(nn.Module):
    """Routed experts plus an always-on shared MLP (Qwen: scaled by sigmoid(shared_gate(x))); experts as [e, out, in].

    Nemotron-H's latent MoE runs its experts on latent_in(x) and projects their sum back with latent_out."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the group."""
        super().__init__()
        ff = config.feed_forward
        if ff.num_experts % max(1, ff.num_expert_groups) or not 1 <= ff.topk_groups <= ff.num_expert_groups:
            raise ValueError(
                f"{ff.num_experts} experts cannot form {ff.num_expert_groups} groups of which {ff.topk_groups} are kept"
            )
        if not 1 <= ff.experts_per_token <= ff.num_experts:
            raise ValueError(f"experts_per_token={ff.experts_per_token} must lie in 1 … {ff.num_experts}")
        self.gated, self.tp = ff.gated, tp
        self.first_expert, self.num_local_experts = local_experts(ff.num_experts, tp)
        self.intermediate_size = ff.expert_intermediate_size  # per expert, this rank's share (kept when packed)
        # Expert parallel over several ranks: some of a token's experts are another rank's.
        self.partial_experts = tp.parallel and tp.expert_parallel
        width = ff.latent_size or config.hidden_size
        self.router = Router(config.hidden_size, ff)
        up_rows = ff.expert_intermediate_size * (2 if ff.gated else 1)
        self.experts_up = nn.Parameter(torch.zeros(self.num_local_experts, up_rows, width))
        self.experts_down = nn.Parameter(torch.zeros(self.num_local_experts, width, ff.expert_intermediate_size))
        self.packed: native_moe.PackedExperts | None = None  # set by `pack` (the Parameters then go)
        self.fp8_experts: nn.Module | None = None  # experts kept FP8 (`layers/fp8_experts.py`; the Parameters go)
        # No shared MLP when its width is 0 (Jamba's and LFM2-MoE's MoE have none).
        shared_size = ff.shared_expert_intermediate_size
        self.shared = MLP(config.hidden_size, shared_size, ff.gated, ff.bias, tp=tp) if shared_size else None
        self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False) if ff.shared_expert_gate else None
        self.latent_in = nn.Linear(config.hidden_size, ff.latent_size, bias=ff.bias) if ff.latent_size else None
        self.latent_out = nn.Linear(ff.latent_size, config.hidden_size, bias=ff.bias) if ff.latent_size else None

    def shard_rules(self) -> dict[str, ShardRule]:
        """The experts: whole ones by rank (expert parallel) or every expert's gate_r | up_r rows and down
        columns; latent_out's bias on rank 0 (it projects a partial). The shared MLP states its own."""
        if not self.tp.parallel:
            return {}
        tp, local = self.tp, self.intermediate_size
        if tp.expert_parallel:
            experts = (self.first_expert, self.num_local_experts)
            stated = {"experts_up": rows(experts), "experts_down": rows(experts)}
        else:
            pieces = [share(tp, local), share(tp, local, local * tp.size)] if self.gated else [share(tp, local)]
            stated = {"experts_up": rows(*pieces, dim=1), "experts_down": rows(share(tp, local), dim=2)}
        if self.latent_out is not None and self.latent_out.bias is not None:
            stated["latent_out.bias"] = RANK0_ONLY
        return stated

    def _local_slots(
        self, weights: torch.Tensor, ids: torch.Tensor, native_ids: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: (weights, local expert ids) with the other ranks' slots as id -1 (`native_ids`: the
        native and eager paths skip them) or, in the static path's fixed shapes, as the id one past the last local
        expert, whose rows no grouped GEMM computes (zeros), at weight 0."""
        local_ids = ids - self.first_expert
        here = (local_ids >= 0) & (local_ids < self.num_local_experts)
        if native_ids:
            return weights, torch.where(here, local_ids, -1).contiguous()
        return torch.where(here, weights, 0.0), torch.where(here, local_ids, self.num_local_experts)

    def pack(self, weight_format: str | None) -> None:
        """Pack the experts for the native kernels in `weight_format` (None: float32, "int8_weight_only",
        "bfloat16") and the router's weight as float32 panels; the float32 Parameters (experts and router) are freed.
        Experts kept in FP8 are not packed (they run `Fp8Experts`)."""
        if self.fp8_experts is not None:
            return
        with torch.no_grad():
            self.packed = native_moe.pack_experts(self.experts_up, self.experts_down, self.gated, weight_format)
            self.router.panels = native.pack_panels(self.router.weight.detach().float())
        del self.experts_up, self.experts_down, self.router.weight

    def forward(self, hidden: torch.Tensor, static_shapes: bool = False) -> torch.Tensor:
        """[..., d] → [..., d]. `static_shapes`: the CUDA graph form (see the module docstring)."""
        tokens = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [t, d]
        weights, expert_ids = self.router(tokens)
        x = self.latent_in(tokens) if self.latent_in is not None else tokens
        # On CUDA the static form runs eager steps too: no host sync per expert.
        static = static_shapes or (x.is_cuda and static_form_reason(x.device, x.dtype) is None)
        if self.partial_experts:
            # FP8 experts take the static form's ids on every path (their Triton GEMM aligns them like `_rows_static`).
            skipped_as_minus_one = self.packed is not None or (not static and self.fp8_experts is None)
            weights, expert_ids = self._local_slots(weights, expert_ids, skipped_as_minus_one)
        if self.packed is not None:
            routed = native_moe.experts(x.contiguous(), weights, expert_ids, self.packed)
        else:
            if self.fp8_experts is not None:
                out = self.fp8_experts(x, expert_ids)
            else:
                rows = _rows_static if static else _rows_eager
                out = rows(x, expert_ids, self.experts_up, self.experts_down, self.gated)  # [t · k, w]
            k = expert_ids.shape[1]
            routed = (out.view(-1, k, out.shape[-1]).float() * weights.unsqueeze(-1)).sum(1).to(hidden.dtype)
        if self.latent_out is not None:
            routed = self.latent_out(routed)
        if self.shared is None:
            return routed.view_as(hidden)
        shared = self.shared(tokens)
        gate = self.shared_gate(tokens) if self.shared_gate is not None else None
        if self.packed is not None:
            return native_moe.combine(routed, shared, gate).view_as(hidden)
        if gate is not None:
            shared = torch.sigmoid(gate) * shared
        return (routed + shared).view_as(hidden)


def _rows_eager(x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gated: bool) -> torch.Tensor:
    """Each (token, slot) pair's expert output [t · k, w], one pair of matmuls per used expert; zeros for an id
    of -1 (expert parallel: another rank's expert)."""
    k, flat = ids.shape[1], ids.reshape(-1)
    skipped = bool((flat < 0).any())
    out = x.new_zeros(flat.shape[0], down.shape[1]) if skipped else x.new_empty(flat.shape[0], down.shape[1])
    for expert in flat.unique().tolist():
        if expert < 0:
            continue
        pairs = (flat == expert).nonzero().squeeze(1)
        out[pairs] = F.linear(activate(F.linear(x[pairs // k], up[expert]), gated), down[expert])
    return out


def _rows_static(x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gated: bool) -> torch.Tensor:
    """`_rows_eager` in static shapes: `torch._grouped_mm` where it runs, else the Triton grouped GEMM. An id of
    E (the experts held here; expert parallel: another rank's expert) gives zeros, no GEMM rows."""
    if grouped_gemm_fits(x.device, x.dtype):
        return _rows_grouped(x, ids, up, down, gated)
    from workers.model.kernels.triton_kernels import moe as triton_moe  # imports triton: only where it runs

    return triton_moe.expert_rows(x, ids, up, down, gated, activate)


def _rows_grouped(
    x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gated: bool
) -> torch.Tensor:
    """As `_rows_eager`, in static shapes: pairs sorted by expert on the device, each projection one grouped GEMM
    over all experts' rows (`offs`: where each expert's rows end). Pairs of id E sort last, past the last offset:
    the GEMMs leave their rows unwritten, and they are zeroed."""
    k, flat, num_experts = ids.shape[1], ids.reshape(-1), up.shape[0]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts[:num_experts].cumsum(0, dtype=torch.int32)
    h = activate(grouped_mm(x[order // k], up.transpose(1, 2), offs=offsets), gated)
    sorted_out = grouped_mm(h, down.transpose(1, 2), offs=offsets)
    out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    return torch.where((flat < num_experts)[:, None], out, 0.0)
