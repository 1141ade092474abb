"""How a step's forwards execute, chosen once per scheduler (STYLE: "The step, as it grows").

- `ModuleExecutor` ("module"): module by module, the reference path; prefill always runs this way;
- `PlanExecutor` ("native" or "graph"): decode and verification steps of compacted rows (slots 0 … n-1) as one call
  of a plan — the CPU decode plan (`workers/model/steps/decode_plan.py`) or the CUDA graph plan
  (`workers/model/steps/cuda_graph.py`, captured on CUDA, its eager form elsewhere) — other rows module by module.

Both have one interface — `prefill`, `decode`, `verify`, `keep` — so the scheduler holds one and never asks which it
is. A proposer that drafts from the target's hidden states (MTP) reads them from the decode plan's `last_hidden`;
the graph plan does not hand them out, so it is never chosen for such a proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model import ForwardBatch, HybridModel, StatePool
from workers.model.steps import cuda_graph, decode_plan
from workers.model.steps.cuda_graph import GraphCaptureError, GraphPlan
from workers.model.steps.decode_plan import DecodePlan
from workers.requests import Request

MODULE, NATIVE, GRAPH = "module", "native", "graph"


@dataclass
class Verification:
    """A verification forward's output, until `keep` shifts the states to the accepted count."""

    logits: torch.Tensor  # [num_reqs, max_k + 1, v]
    cache_lens: list[int]  # tokens of each row before the step's inputs
    hidden: torch.Tensor | None = None  # [num_reqs, max_k + 1, d]; the module path's
    old_states: list | None = None  # the module path's states before the step, and its scan inputs
    scan_inputs: list | None = None


class ModuleExecutor:
    """Every forward module by module over the state pool (`HybridModel.forward`)."""

    kind = MODULE

    def __init__(self, model: HybridModel, pool: StatePool, want_hidden: bool):
        """`want_hidden`: hand out the target's final hidden states (a proposer drafts from them)."""
        self.model, self.pool, self.want_hidden = model, pool, want_hidden
        self.device = model.embed_tokens.weight.device

    def slots(self, requests: list[Request]) -> torch.Tensor:
        """The requests' slots, on the device."""
        return torch.tensor([r.slot for r in requests], device=self.device)

    def prefill(self, requests: list[Request], chunks: list[int]) -> torch.Tensor:
        """The next chunk of each request's prompt, continuing its state (new rows start from zero states); the
        states are written back. Returns the final hidden states [b, max chunk, d]."""
        starts = [r.num_computed for r in requests]
        input_ids = torch.zeros(len(requests), max(chunks), dtype=torch.long)
        for row, (r, start, n) in enumerate(zip(requests, starts, chunks)):
            input_ids[row, :n] = torch.tensor(r.prompt[start : start + n])
            self.pool.blocks.ensure(r.slot, start + n)
        slots, num_tokens = self.slots(requests), torch.tensor(chunks, device=self.device)
        batch = ForwardBatch(slots, torch.tensor(starts, device=self.device), num_tokens)
        states = None
        if any(starts):  # rows continuing from their states; new rows beside them start from zero states
            states = self.pool.read(slots)
            fresh = [row for row, start in enumerate(starts) if start == 0]
            for state in states:  # copies: zeroing them leaves the slots alone
                state.conv[fresh] = 0
                state.ssm[fresh] = 0
        out = self.model(input_ids.to(self.device), batch, states, self.pool.kv_caches())
        self.pool.write(slots, out.mamba_states)
        return out.hidden

    def decode(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token for every row, states updated in their slots: (logits [b, v], hidden [b, 1, d] when wanted)."""
        for r in requests:
            self.pool.blocks.ensure(r.slot, r.num_tokens)
        prefix = _compacted(requests)  # views of the pool, no copies
        slots = self.slots(requests)
        input_ids = torch.tensor([[r.last_token] for r in requests], device=self.device)
        cache_lens = torch.tensor([r.num_tokens - 1 for r in requests], device=self.device)
        batch = ForwardBatch(
            slots, cache_lens, torch.ones_like(cache_lens), slots_are_prefix=prefix, one_token_each=True
        )
        states = self.pool.prefix(len(requests)) if prefix else self.pool.read(slots)
        out = self.model(input_ids, batch, states, self.pool.kv_caches(), in_place=True)
        if not prefix:
            self.pool.write(slots, out.mamba_states)
        return self.model.logits(out.hidden[:, 0]), out.hidden

    def verify(self, requests: list[Request], host_ids: torch.Tensor, num_drafts: torch.Tensor) -> Verification:
        """The target over `host_ids` [b, max_k + 1] (row i: x_last, its num_drafts[i] drafts, padding), keeping
        its scan inputs for the shift."""
        slots, cache_lens = self.slots(requests), [r.num_tokens - 1 for r in requests]
        old_states = self.pool.read(slots)
        batch = ForwardBatch(slots, torch.tensor(cache_lens, device=self.device), num_drafts + 1)
        out = self.model(host_ids.to(self.device), batch, old_states, self.pool.kv_caches(), keep_scan_inputs=True)
        logits = self.model.logits(out.hidden)
        return Verification(logits, cache_lens, out.hidden, old_states, out.scan_inputs)

    def keep(
        self, requests: list[Request], verification: Verification, accepted: list[int], counts: torch.Tensor
    ) -> torch.Tensor | None:
        """Shift every row's states to those after input accepted[i] − 1 (`counts`: the same on the device).
        Returns the verification's hidden states when wanted."""
        assert verification.old_states is not None
        shifted = self.model.states_after(verification.old_states, verification.scan_inputs, counts)
        self.pool.write(self.slots(requests), shifted)
        return verification.hidden


class PlanExecutor(ModuleExecutor):
    """Decode and verification steps of compacted rows as one plan call each (`run`, `verify`, `keep`)."""

    def __init__(self, model: HybridModel, pool: StatePool, want_hidden: bool, plan: DecodePlan | GraphPlan):
        super().__init__(model, pool, want_hidden)
        self.plan = plan
        self.kind = GRAPH if isinstance(plan, GraphPlan) else NATIVE

    def decode(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ModuleExecutor.decode`, planned when the rows are compacted."""
        if not _compacted(requests):
            return super().decode(requests)
        for r in requests:
            self.pool.blocks.ensure(r.slot, r.num_tokens)
        logits = self.plan.run([r.last_token for r in requests], [r.num_tokens - 1 for r in requests])
        return logits, self.plan.last_hidden() if self.want_hidden else None

    def verify(self, requests: list[Request], host_ids: torch.Tensor, num_drafts: torch.Tensor) -> Verification:
        """`ModuleExecutor.verify`, planned when the rows are compacted (the plan keeps what the shift needs)."""
        if not _compacted(requests):
            return super().verify(requests, host_ids, num_drafts)
        cache_lens = [r.num_tokens - 1 for r in requests]
        return Verification(self.plan.verify(host_ids.tolist(), cache_lens), cache_lens)

    def keep(
        self, requests: list[Request], verification: Verification, accepted: list[int], counts: torch.Tensor
    ) -> torch.Tensor | None:
        """`ModuleExecutor.keep`; a planned verification keeps through its plan."""
        if verification.old_states is not None:
            return super().keep(requests, verification, accepted, counts)
        self.plan.keep(accepted)
        return self.plan.last_hidden() if self.want_hidden else None


def _compacted(requests: list[Request]) -> bool:
    """Whether the rows hold slots 0 … n-1 in order (the scheduler compacts live requests there)."""
    return [r.slot for r in requests] == list(range(len(requests)))


def tensor_parallel_size(model: HybridModel) -> int:
    """The ranks `model` is split over (1: the whole model on this rank)."""
    return model.tp.size


def choose_executor(model: HybridModel, decode_plan_on: bool, cuda_graphs: bool, drafts_from_hidden: bool) -> str:
    """The executor for this model: graphs when asked and possible, else the decode plan when asked and
    possible, else the module path. `drafts_from_hidden`: the proposer drafts from the target's hidden states.
    A model split over ranks runs module by module: the plans hold no collectives yet."""
    if tensor_parallel_size(model) > 1:
        return MODULE
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


def make_executor(
    model: HybridModel, pool: StatePool, plan: DecodePlan | GraphPlan | None, want_hidden: bool
) -> ModuleExecutor:
    """The executor over a workspace: its plan's when it has one, else the module path."""
    return ModuleExecutor(model, pool, want_hidden) if plan is None else PlanExecutor(model, pool, want_hidden, plan)
