"""The runner's one log line about how decode steps run: kernels, decode plan, CUDA graphs, the MTP head's plan."""

from __future__ import annotations

from workers.model import HybridModel
from workers.model.kernels import native
from workers.model.steps import cuda_graph, decode_plan, mtp_plan


def executor_summary(model: HybridModel, decode_plan_on: bool, cuda_graphs: bool, drafts_from_hidden: bool) -> str:
    """The decode plan and CUDA graph parts of the runner's one log line about how steps run."""
    plan_reason = decode_plan.unsupported_reason(model) if decode_plan_on else "turned off"
    graph_reason = cuda_graph.unsupported_reason(model, drafts_from_hidden) if cuda_graphs else "turned off"
    device = next(model.parameters()).device
    graphs = "off" if graph_reason is not None else "on" if device.type == "cuda" else "eager form (no CUDA)"
    if graph_reason is not None:
        graphs += f" ({graph_reason})"
    plan = "on" if plan_reason is None else f"off ({plan_reason})"
    if graph_reason is None:
        plan = "not used (CUDA graphs run the steps)"
    return f"decode plan {plan}; CUDA graphs {graphs}"


def execution_summary(model: HybridModel, decode_plan: bool, cuda_graphs: bool = False, mtp: bool = False) -> str:
    """How decode steps run (logged once per runner): the recurrent layers' decode kernel, the decode plan and
    CUDA graphs (`mtp`: the proposer drafts from the target's hidden states), the MTP head's plan."""
    kernels = sorted({m.decode_kernel for m in model.modules() if hasattr(m, "decode_kernel")})
    summary = f"recurrent decode kernel {','.join(kernels) or 'none (no recurrent layers)'}; "
    summary += executor_summary(model, decode_plan, cuda_graphs, mtp)
    if native.loaded():
        summary += f"; native CPU kernels: {native.describe()}"
    if mtp:
        reason = mtp_plan.unsupported_reason(model) if decode_plan else "turned off"
        summary += "; MTP head plan " + ("on" if reason is None else f"off ({reason})")
    return summary
