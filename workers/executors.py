"""How the scheduler's decode and verification steps execute, chosen once per runner (STYLE: "The step, as it grows").

- "module": module by module, the reference path (prefill and anything else not planned always runs this way);
- "native": the CPU decode plan, one native call per step (`workers/model/steps/decode_plan.py`);
- "graph": the CUDA graph plan (`workers/model/steps/cuda_graph.py`), captured on CUDA, its eager form elsewhere.

Plans share one interface — `run`, `verify`, `keep`, `tokens_per_row` — so the scheduler holds one and never
branches on which it is. A proposer that drafts from the target's hidden states (MTP) reads them from the decode
plan's `last_hidden`; the graph plan does not hand them out, so it is never chosen for such a proposer.
"""

from __future__ import annotations

from workers.model import HybridModel, StatePool
from workers.model.kernels import native
from workers.model.steps import cuda_graph, decode_plan, mtp_plan
from workers.model.steps.cuda_graph import GraphCaptureError, GraphPlan
from workers.model.steps.decode_plan import DecodePlan

MODULE, NATIVE, GRAPH = "module", "native", "graph"


def choose_executor(model: HybridModel, decode_plan_on: bool, cuda_graphs: bool, drafts_from_hidden: bool) -> str:
    """The executor for this model: graphs when asked and possible, else the decode plan when asked and
    possible, else the module path. `drafts_from_hidden`: the proposer drafts from the target's hidden states."""
    if cuda_graphs and cuda_graph.unsupported_reason(model, drafts_from_hidden) is None:
        return GRAPH
    if decode_plan_on and decode_plan.unsupported_reason(model) is None:
        return NATIVE
    return MODULE


def extra_slots(kind: str) -> int:
    """State slots an executor needs beside the requests' own: the graph plan's null slot."""
    return 1 if kind == GRAPH else 0


def build_plan(
    kind: str, model: HybridModel, pool: StatePool, tokens_per_row: int
) -> tuple[DecodePlan | GraphPlan | None, str | None]:
    """(the plan of executor `kind` over `pool`, None) — or (None, why) when CUDA graph capture failed: the steps
    then run module by module."""
    if kind == NATIVE:
        return DecodePlan(model, pool, tokens_per_row), None
    if kind == GRAPH:
        try:
            return GraphPlan(model, pool, tokens_per_row), None
        except GraphCaptureError as error:
            return None, str(error)
    return None, None


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
