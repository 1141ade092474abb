"""Decode and verification steps as CUDA graphs: the GPU counterpart of the CPU decode plan (`decode_plan.py`).

Eagerly, a decode step launches several hundred kernels from Python, and at small batch a GPU step is bound by
those launches, not by memory (NOTES.md §10: 26.5 ms eager vs 2.67 ms graphed at batch 1). A `GraphPlan` runs each
step over static buffers so the same kernels, on the same addresses, can be captured once and replayed:

1. Inputs (token ids, positions, slot ids, accepted counts) are copied into static buffers on the device.
2. The batch is padded to a bucket (1, 2, 4, 8, then steps of 8 up to 64, steps of 16 above); padded rows point at
   a null state slot — the pool's last slot, which no request uses, whose block-table row holds only the null
   block — so they read and write nothing a request owns.
3. The step gathers the rows' recurrent states, runs the static-shape forward (`HybridModel.forward(...,
   static_shapes=True)`), scatters the new states back and copies the logits into a buffer shared by all buckets.
   Verification keeps its scan inputs in shared buffers too; `keep` then shifts the states inside a second graph
   (`states_after(..., static_shapes=True)`) from accepted counts in a static buffer.

On CUDA every (step, bucket) is captured into one shared memory pool, largest bucket first, after a warm-up run on
a side stream (PyTorch's recipe). Without capture (`capture=False`, the default on CPU) the very same step functions
run eagerly — the form CI tests against the module path, and `find_capture_hazards` checks (`captured_step`), for
every family (tests/workers/model/test_cuda_graph.py). With `decode_kernel="triton"` (the default on CUDA) the
recurrent one-token steps and the keep step's state shifts run as Triton kernels (`kernels/triton_kernels/`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from workers.model.checkpoint.config import MOE
from workers.model.layers.fp8_experts import FP8_EXPERTS_GRAPH_REASON, Fp8Experts
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.moe import static_form_reason
from workers.model.state import DeltaScanInputs, ForwardBatch, ScanInputs, StatePool
from workers.model.steps.decode_plan import TENSOR_PARALLEL_REASON, check_step

DECODE, VERIFY, KEEP = "decode", "verify", "keep"


def batch_buckets(max_rows: int) -> list[int]:
    """Padded batch sizes for up to `max_rows` rows: 1, 2, 4, 8, steps of 8 up to 64, steps of 16 above, and
    `max_rows` itself as the largest."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_rows, 16)]
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


def unsupported_reason(model: HybridModel, drafts_from_hidden: bool = False) -> str | None:
    """Why decode steps of `model` cannot run as CUDA graphs, or None when they can. `drafts_from_hidden`: a
    proposer drafts from the target's hidden states (MTP).

    Every family's blocks have a static form (Mamba2, Gated DeltaNet, Mamba1, Kimi Delta Attention, short conv,
    attention with latent caches, sliding windows, post-norms or shared blocks); the reasons left are MoE experts
    where neither `torch._grouped_mm` nor Triton runs, and MTP drafting."""
    if model.tp.parallel:
        return TENSOR_PARALLEL_REASON
    weight = model.embed_tokens.weight
    if any(isinstance(m, Fp8Experts) for m in model.modules()):
        return FP8_EXPERTS_GRAPH_REASON
    if any(block.kind == MOE for block in model.blocks):
        reason = static_form_reason(weight.device, weight.dtype)
        if reason is not None:
            return f"{reason}: use --dtype bfloat16"
    if drafts_from_hidden:
        return "MTP drafts read the target's hidden states, which the graph step does not hand out"
    return None


class GraphCaptureError(RuntimeError):
    """A step could not be captured (the runner then runs its steps eagerly)."""


class GraphPlan:
    """Decode steps (`run`) and verification steps (`verify`, then `keep`) over static buffers, replayed as CUDA
    graphs when captured. Same interface as `DecodePlan`; rows 0 … b-1 are the pool's slots 0 … b-1."""

    def __init__(self, model: HybridModel, pool: StatePool, tokens_per_row: int = 1, capture: bool | None = None):
        """`pool` must hold one slot more than any step's rows (the null slot, its last). `tokens_per_row`: the
        longest verification (k + 1); shorter ones are padded to it. `capture`: capture CUDA graphs (default: on
        CUDA devices); raises `GraphCaptureError` when a capture fails."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"this model cannot run as CUDA graphs: {reason}")
        if pool.num_slots < 2:
            raise ValueError("a graph plan needs a pool with at least one slot besides its null slot")
        self.model, self.pool, self.tokens_per_row = model, pool, tokens_per_row
        device = pool.conv.device
        self.capture = device.type == "cuda" if capture is None else capture
        self.null_slot, self.max_rows = pool.num_slots - 1, pool.num_slots - 1
        self.buckets = batch_buckets(self.max_rows)
        rows = self.buckets[-1]
        # Static inputs [rows] / [rows, l]; rows past a step's b point at the null slot from position 0.
        self.token_ids = torch.zeros(rows, tokens_per_row, dtype=torch.int64, device=device)
        self.cache_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_ids = torch.full((rows,), self.null_slot, dtype=torch.int64, device=device)
        self.accepted = torch.ones(rows, dtype=torch.int64, device=device)  # num_accepted_tokens for `keep`
        self.one_token = torch.ones(rows, dtype=torch.int64, device=device)
        self.all_tokens = torch.full((rows,), tokens_per_row, dtype=torch.int64, device=device)
        self._stores: dict[str, list[torch.Tensor]] = {}  # step outputs, [rows, ...], shared by every bucket
        self._scan_layout: list[tuple[type, list[str]]] = []  # how the verify store's tensors rebuild scan inputs
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._verified: tuple[int, int, int] | None = None  # (b, bucket, l) of the last verification, until `keep`
        self._clear_null_slot()
        if self.capture:
            try:
                self._capture_all()
            except Exception as error:  # any failure of any capture: the caller falls back to eager steps
                raise GraphCaptureError(f"{type(error).__name__}: {error}") from error
            self._clear_null_slot()  # warm-up runs wrote scratch there

    # ------------------------------------------------------------------------------------------------ interface
    def run(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One step for rows 0 … b-1: input `token_ids` at `positions` (= tokens already cached) → logits [b, v],
        a view of a buffer the next step overwrites. Updates the pool's states and KV caches in place."""
        b, bucket = self._load([[t] for t in token_ids], positions)
        self._execute(DECODE, bucket)
        return self._stores[DECODE][0][:b]

    def verify(self, token_ids: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Rows 0 … b-1 each run l tokens from `positions` on → logits [b, l, v]. KV entries are written for every
        token; the recurrent states stay those before the step until `keep` shifts them."""
        if token_ids and len(token_ids[0]) == 1:
            return self.run([row[0] for row in token_ids], positions)[:, None]
        b, bucket = self._load(token_ids, positions)
        self._execute(VERIFY, bucket)
        self._verified = (b, bucket, len(token_ids[0]))
        return self._stores[VERIFY][0][:b, : len(token_ids[0])]

    def keep(self, num_accepted_tokens: list[int]) -> None:
        """After `verify`: each row keeps its states after input num_accepted_tokens − 1 (1 ≤ n ≤ l)."""
        if self._verified is None:
            raise RuntimeError("keep() needs a verification of more than one token per row before it")
        (b, bucket, length), self._verified = self._verified, None
        if len(num_accepted_tokens) != b or not all(1 <= n <= length for n in num_accepted_tokens):
            raise ValueError(f"accepted counts must be 1 … {length} for each of {b} rows, got {num_accepted_tokens}")
        counts = torch.ones(bucket, dtype=torch.int64)
        counts[:b] = torch.tensor(num_accepted_tokens, dtype=torch.int64)
        self.accepted[:bucket].copy_(counts, non_blocking=True)
        self._execute(KEEP, bucket)

    def captured_step(self, kind: str, bucket: int) -> Callable[[], None]:
        """The step a graph captures for `kind` ("decode", "verify", "keep") and `bucket` rows: it reads only the
        static buffers and the pool, and writes only the pool and the shared output buffers."""
        step = {DECODE: self._decode_step, VERIFY: self._verify_step, KEEP: self._keep_step}[kind]
        return lambda: step(bucket)

    # ------------------------------------------------------------------------------------------------ the steps
    def _decode_step(self, bucket: int) -> None:
        slots = self.slot_ids[:bucket]
        batch = ForwardBatch(slots, self.cache_lens[:bucket], self.one_token[:bucket], one_token_each=True)
        states = self.pool.read(slots)  # gathered copies, updated in place, scattered back
        out = self.model(
            self.token_ids[:bucket, :1], batch, states, self.pool.kv_caches(), in_place=True, static_shapes=True
        )
        self.pool.write(slots, out.mamba_states)
        self._store(DECODE, [self.model.logits(out.hidden[:, 0])])

    def _verify_step(self, bucket: int) -> None:
        slots = self.slot_ids[:bucket]
        batch = ForwardBatch(slots, self.cache_lens[:bucket], self.all_tokens[:bucket])
        out = self.model(
            self.token_ids[:bucket],
            batch,
            self.pool.read(slots),
            self.pool.kv_caches(),
            keep_scan_inputs=True,
            static_shapes=True,
        )
        if not self._scan_layout:
            self._scan_layout = [(type(s), [f.name for f in dataclasses.fields(s)]) for s in out.scan_inputs]
        scans = [getattr(s, name) for s, (_, names) in zip(out.scan_inputs, self._scan_layout) for name in names]
        self._store(VERIFY, [self.model.logits(out.hidden), *scans])

    def _keep_step(self, bucket: int) -> None:
        """The state shift: from the states the verification started from (still in the pool) and its kept scan
        inputs, each row's states after its accepted inputs."""
        slots = self.slot_ids[:bucket]
        stored = iter(t[:bucket] for t in self._stores[VERIFY][1:])
        scans: list[ScanInputs | DeltaScanInputs] = [
            kind(**{name: next(stored) for name in names}) for kind, names in self._scan_layout
        ]
        new = self.model.states_after(self.pool.read(slots), scans, self.accepted[:bucket], static_shapes=True)
        self.pool.write(slots, new)

    def _store(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Copy a step's outputs into buffers of the largest bucket's size (allocated on first use, outside any
        capture: the warm-up comes first), so every bucket's graph writes the same memory."""
        stored = self._stores.get(name)
        if stored is None:
            rows = self.buckets[-1]
            stored = self._stores[name] = [t.new_empty((rows, *t.shape[1:])) for t in tensors]
        for buffer, tensor in zip(stored, tensors):
            buffer[: tensor.shape[0]].copy_(tensor)

    # ------------------------------------------------------------------------------------------------ machinery
    def _load(self, token_ids: list[list[int]], positions: list[int]) -> tuple[int, int]:
        """Check a step's inputs and copy them into the static buffers; (b, its bucket)."""
        b, length = check_step(token_ids, positions, self.max_rows, self.tokens_per_row)
        blocks, vocab = self.pool.blocks, self.model.config.vocab_size
        last = blocks.max_blocks_per_slot * blocks.block_size - (1 if length == 1 else self.tokens_per_row)
        if any(not 0 <= t < vocab for row in token_ids for t in row) or not all(0 <= p <= last for p in positions):
            raise ValueError(f"token ids must lie in [0, {vocab}) and positions in [0, {last}] (the KV capacity)")
        bucket = next(size for size in self.buckets if size >= b)
        ids = torch.zeros(bucket, self.tokens_per_row, dtype=torch.int64)
        ids[:b, :length] = torch.tensor(token_ids, dtype=torch.int64)
        cache_lens, slots = torch.zeros(bucket, dtype=torch.int64), torch.full((bucket,), self.null_slot)
        cache_lens[:b], slots[:b] = torch.tensor(positions, dtype=torch.int64), torch.arange(b)
        for buffer, values in ((self.token_ids, ids), (self.cache_lens, cache_lens), (self.slot_ids, slots)):
            buffer[:bucket].copy_(values, non_blocking=True)
        return b, bucket

    def _execute(self, kind: str, bucket: int) -> None:
        with torch.inference_mode():
            graph = self._graphs.get((kind, bucket))
            if graph is not None:
                graph.replay()
            else:
                self.captured_step(kind, bucket)()

    def _clear_null_slot(self) -> None:
        """Zero the null slot's recurrent states and the null KV block: padded rows then compute finite scratch."""
        self.pool.conv[:, self.null_slot].zero_()
        self.pool.ssm[:, self.null_slot].zero_()
        size = self.pool.blocks.block_size
        self.pool.key[:, :, :size].zero_()
        self.pool.value[:, :, :size].zero_()

    def _capture_all(self) -> None:
        """Capture every (step, bucket), largest bucket first, into one memory pool (smaller graphs reuse the
        memory of larger ones); each after a warm-up run on a side stream, as PyTorch's CUDA graph docs do."""
        kinds = [DECODE] + ([VERIFY, KEEP] if self.tokens_per_row > 1 else [])
        with torch.inference_mode(), torch.cuda.device(self.token_ids.device):
            memory_pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.buckets):
                for kind in kinds:
                    step = self.captured_step(kind, bucket)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        step()  # warm-up: lazy initialisation, Triton compilation, first allocation of the stores
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=memory_pool):
                        step()
                    self._graphs[(kind, bucket)] = graph
            torch.cuda.synchronize()
