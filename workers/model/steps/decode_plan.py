"""A whole-model decode step as one native call: the CPU counterpart of a CUDA graph.

Module by module, a decode step of the bench model makes ~70 kernel calls from Python, and at batch 1 the
interpreter's share (argument checks, output allocation, ctypes) was ~4–5 ms of a ~17 ms step. A `DecodePlan`
records those same calls once per batch size — weights, state slots 0 … b-1 of a `StatePool`, and scratch
buffers allocated once — and `csrc/decode_plan.c` replays them. Each record calls the kernel the module path would
call with the same arguments, so logits, states and KV caches match that path bit for bit (tests check it).

It covers models whose every block runs native on the module path: Mamba2, Mamba1 (Jamba; `mamba1_records.py`) and
Gated DeltaNet mixers with their native decode kernels, attention (NoPE or RoPE; the gated attention of Qwen3.5 / Qwen3-Next with per-head q/k
norms and partial RoPE), dense MLPs (SwiGLU or relu²), native linears and norms (CPU, float32). Zero-centred
RMSNorms (Qwen) need nothing of their own: the loader stores 1 + w, and both paths run the plain RMSNorm kernel.
Falcon-H1's parallel blocks record their Mamba2 branch and their attention branch, then sum the two outputs.
MoE blocks record the calls `MoE.forward` makes on the native path (`feed_forward_records.py`), Zamba2's shared-block
uses those of `SharedBlockUse.forward` (`shared_block_records.py`). LFM2 / LFM3's short convs, sandwich norms,
per-head output gates and sliding windows, and OLMo-Hybrid's post-norm blocks (with their whole-width q/k norms and
beta = 2·sigmoid(b) Gated DeltaNets) have theirs in `lfm_olmo_records.py`, Kimi-Linear's Kimi Delta Attention and latent attention
blocks in `kimi_records.py`. Anything else
(other dtypes, the torch kernels) keeps the module path; `unsupported_reason` says why.
"""

from __future__ import annotations

import torch

from workers.model.checkpoint.config import (
    ATTENTION,
    ATTENTION_KINDS,
    GDN,
    KDA,
    MAMBA,
    MAMBA1,
    MLP,
    MOE,
    PARALLEL,
    RECURRENT_KINDS,
    SHARED_ATTENTION,
    SHORT_CONV,
)
from workers.model.kernels import native
from workers.model.layers.fp8_experts import Fp8Experts
from workers.model.layers.fp8_linear import FP8_KEPT_REASON, Fp8BlockLinear
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.linear import NativeLinear
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.norm import PassThroughNorm
from workers.model.state import StatePool
from workers.model.steps.decode_records import DecodeRecords, branches, kept_width
from workers.model.steps.feed_forward_records import MoeScratch, moe_unsupported_reason
from workers.model.steps.kimi_records import KimiScratch, kimi_unsupported_reason
from workers.model.steps.lfm_olmo_records import HeadGateScratch, post_norm_unsupported_reason
from workers.model.steps.mamba1_records import Mamba1Scratch
from workers.model.steps.plan_records import RECORD_WORDS
from workers.model.steps.shared_block_records import SharedBlockScratch, shared_block_unsupported_reason


def check_step(token_ids: list[list[int]], positions: list[int], max_rows: int, tokens_per_row: int) -> tuple[int, int]:
    """(b, l) of a step's [b, l] token ids with one position per row, or ValueError saying what is wrong."""
    b, length = len(token_ids), len(token_ids[0]) if token_ids else 0
    if not 1 <= b <= max_rows or len(positions) != b or not 1 <= length <= tokens_per_row:
        raise ValueError(
            f"a step needs 1 … {max_rows} rows of 1 … {tokens_per_row} tokens and one position per row, got {b} "
            f"rows of {length} tokens and {len(positions)} positions"
        )
    if any(len(row) != length for row in token_ids):
        raise ValueError("every row of a step needs the same number of tokens (pad the short ones)")
    return b, length


TENSOR_PARALLEL_REASON = (
    "the model is split over tensor-parallel ranks: plans and graphs hold no collectives yet (the module path runs)"
)


def unsupported_reason(model: HybridModel) -> str | None:
    """Why `model` cannot run as a decode plan, or None when it can."""
    if model.tp.parallel:
        return TENSOR_PARALLEL_REASON
    if any(isinstance(m, (Fp8BlockLinear, Fp8Experts)) for m in model.modules()):
        return FP8_KEPT_REASON
    if (reason := shared_block_unsupported_reason(model)) is not None:
        return reason
    norms = [block.norm for block in model.blocks if not isinstance(block.norm, PassThroughNorm)]
    if not all(norm.native for norm in [*norms, model.final_norm]) or not isinstance(model.lm_head, NativeLinear):
        return "the native kernels are off (not CPU float32, or decode_kernel / linear_backend chose another path)"
    if (reason := post_norm_unsupported_reason(model)) is not None:
        return reason
    for block in model.blocks:
        mixer = block.mixer
        if block.kind == KDA or isinstance(mixer, MultiHeadLatentAttention):
            if (reason := kimi_unsupported_reason(mixer)) is not None:
                return reason
            continue
        if block.kind == SHARED_ATTENTION:  # checked by shared_block_unsupported_reason
            continue
        if block.kind not in (MAMBA, GDN, MAMBA1, SHORT_CONV, ATTENTION, MLP, MOE, PARALLEL):
            return f"{block.kind} blocks are not covered"
        if block.kind == MOE and (reason := moe_unsupported_reason(mixer)) is not None:
            return reason
        linears = [m for m in mixer.modules() if isinstance(m, torch.nn.Linear | NativeLinear)]
        if not all(isinstance(m, NativeLinear) for m in linears):
            return f"a {block.kind} block has linears outside the native kernel"
        recurrent, attention = branches(block)
        if recurrent is not None and recurrent.decode_kernel != "native":
            if block.kind == SHORT_CONV:
                return "short-conv decode steps do not run through the native kernel"
            name = {GDN: "Gated DeltaNet", MAMBA1: "Mamba1"}.get(block.kind, "Mamba2")
            if name == "Mamba2" and not recurrent.config.fused_kernels_fit:
                return "the Mamba2 mixers' norm variant (no norm, or norm before the gate) has no native kernel"
            return f"{name} decode steps do not run through the native kernel"
        if attention is not None:
            head_norms = [norm for norm in (attention.q_norm, attention.k_norm) if norm is not None]
            if not (attention.native and all(norm.native for norm in head_norms)):
                return "attention decode steps do not run through the native kernel"
        if block.kind == MLP and not mixer.native:
            return "MLP activations do not run through the native kernels"
    return None


class DecodePlan(DecodeRecords):
    """Decode steps of `model` for the requests in slots 0 … b-1 of `pool` (any b up to the pool's slot count).

    `run` is a plain step (one token per row, states updated in place). `verify` runs up to `tokens_per_row` tokens
    per row — speculative verification: every linear once over all the tokens (the weights are read once), each
    attention layer in one call that reads the cache once for all of them, and each Mamba2 / Mamba1 / Gated DeltaNet layer
    walking the tokens on a cached copy of each head's state, which it leaves in the pool as it was.
    `keep(num_accepted_tokens)` then advances each row's recurrent states by its accepted tokens to the state after
    input num_accepted_tokens − 1. Verification and keep run the decode step's arithmetic (the same compiled
    helpers), so logits and states are bit for bit those of plain steps — greedy speculative output equals greedy
    plain output by construction. `last_hidden` hands out the final-norm hidden states of the last step (an MTP
    proposer drafts from them).
    """

    def __init__(self, model: HybridModel, pool: StatePool, tokens_per_row: int = 1):
        """Allocate the buffers for every slot of `pool`; records are built per shape on first use."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"this model cannot run as a decode plan: {reason}")
        self.lib = native.load()
        if self.lib.decode_plan_record_words() != RECORD_WORDS:
            raise native.NativeKernelError("decode_plan.c and decode_plan.py disagree on the record size")
        self.model, self.pool, self.tokens_per_row = model, pool, tokens_per_row
        config = model.config
        rows, tokens, d = pool.num_slots, pool.num_slots * tokens_per_row, config.hidden_size
        self.max_rows = rows
        linears = [m for block in model.blocks for m in block.mixer.modules() if isinstance(m, NativeLinear)]
        # Token-major rows: token t of row r is row t · b + r, so each token's rows are contiguous.
        self.token_ids = torch.zeros(tokens, dtype=torch.int64)
        self.positions = torch.zeros(tokens_per_row, rows, dtype=torch.int64)
        self.slot_ids = torch.arange(rows, dtype=torch.int64)
        self.hidden, self.normed, self.mixed = (torch.empty(tokens, d) for _ in range(3))
        # Scratch shared by the blocks: in_proj / up_proj / q_proj outputs, and out_proj / down_proj / o_proj inputs.
        self.wide = torch.empty(tokens * max([m.out_features for m in linears], default=1))
        self.narrow = torch.empty(tokens * max([m.in_features for m in linears], default=1))
        # Every recurrent mixer, whatever its kind (Jamba mixes Mamba1 with attention): buffers fit the widest.
        recurrent = [branches(b)[0] for b in model.blocks if b.kind in RECURRENT_KINDS]
        self.xbc = torch.empty(
            tokens, max((m.conv1d.weight.shape[0] for m in recurrent), default=1)
        )  # conv output (a short conv: its input)
        # Verification keeps each recurrent layer's in_proj outputs (Mamba1: x_proj and dt_proj outputs too; KDA: f): `keep`
        # advances the states by the accepted tokens from them.
        kept = pool.conv.shape[0] if tokens_per_row > 1 else 0
        self.kept_proj = torch.empty(kept, tokens * max((kept_width(m) for m in recurrent), default=0) if kept else 0)
        self.mamba1_scratch = Mamba1Scratch([m for m in recurrent if isinstance(m, Mamba1Mixer)], tokens)
        a = config.attention
        # Latent attention (config.mla) projects into `kimi_scratch` instead.
        attention = config.mla is None and any(kind in ATTENTION_KINDS for kind in config.block_kinds)
        kv_width = a.num_kv_heads * a.head_dim if attention else 1
        self.keys, self.values = torch.empty(tokens, kv_width), torch.empty(tokens, kv_width)
        gated = attention and a.output_gate  # q_proj rows [q_h | gate_h] are split into these two
        self.query, self.gate = (torch.empty(tokens, a.num_heads * a.head_dim if gated else 0) for _ in range(2))
        self.logits = torch.empty(tokens, config.vocab_size)
        # A parallel block's attention output (its Mamba2 output is in `mixed`), and the scratch norm of their sum.
        self.branch, self.branch_normed = (
            torch.empty(tokens if PARALLEL in config.block_kinds else 0, d) for _ in "ab"
        )
        self.shared_scratch = SharedBlockScratch(model, tokens)  # Zamba2's shared-block uses
        self.head_gates = HeadGateScratch(model, tokens)
        self.moe_scratch = MoeScratch([b.mixer for b in model.blocks if b.kind == MOE], tokens, d)
        self.kimi_scratch = KimiScratch(model, tokens)
        self._records: dict[tuple[int, int], torch.Tensor] = {}
        self._shift_records: dict[tuple[int, int], torch.Tensor] = {}
        self._verified: tuple[int, int] | None = None  # (b, l) of the last verification, until `keep`
        self._last: tuple[int, int] | None = None  # (b, l) of the last step, for `last_hidden`
        self._referenced: list[torch.Tensor] = []  # tensors the records point into that nothing else holds

    def run(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One step for rows 0 … b-1: input `token_ids` at `positions` (= tokens already cached) → logits [b, v].

        Updates the pool's recurrent states and KV caches as the module path's in-place decode does. The logits are
        a view of a buffer the next step overwrites.
        """
        return self._execute([[t] for t in token_ids], positions)[:, 0]

    def verify(self, token_ids: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Rows 0 … b-1 each run l tokens (padded rows included) from `positions` on → logits [b, l, v].

        KV entries are written for all l tokens; recurrent states are left as they were until `keep` advances them.
        """
        logits = self._execute(token_ids, positions)
        self._verified = (logits.shape[0], logits.shape[1]) if logits.shape[1] > 1 else None
        return logits

    def keep(self, num_accepted_tokens: list[int]) -> None:
        """After `verify`: each row keeps its recurrent states after input num_accepted_tokens − 1 (1 ≤ n ≤ l)."""
        if self._verified is None:
            raise RuntimeError("keep() needs a verification of more than one token per row before it")
        b, length = self._verified
        self._verified = None
        if len(num_accepted_tokens) != b or not all(1 <= n <= length for n in num_accepted_tokens):
            raise ValueError(f"accepted counts must be 1 … {length} for each of {b} rows, got {num_accepted_tokens}")
        records = self._shift_records.get((b, length))
        if records is None:
            records = self._shift_records[(b, length)] = self._record_shift(b, length)
        accepted = torch.tensor(num_accepted_tokens, dtype=torch.int64)
        failed = self.lib.decode_plan_shift(
            records.data_ptr(), records.shape[0], accepted.data_ptr(), torch.get_num_threads()
        )
        assert not failed, "decode_plan_shift refused counts checked above"

    def last_hidden(self) -> torch.Tensor:
        """The final-norm hidden states [b, l, d] of the last `run` or `verify` — what the module path returns as
        `ForwardOutput.hidden`, bit for bit — as a view of a buffer the next step overwrites (`keep` leaves it)."""
        if self._last is None:
            raise RuntimeError("last_hidden() needs a step before it")
        b, length = self._last
        return self.normed[: b * length].view(length, b, -1).transpose(0, 1)

    def _execute(self, token_ids: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Run the records for [b, l] tokens; logits [b, l, v] (a view of the plan's buffer)."""
        b, length = check_step(token_ids, positions, self.max_rows, self.tokens_per_row)
        self.token_ids.numpy()[: b * length] = [row[t] for t in range(length) for row in token_ids]
        self.positions.numpy()[:length, :b] = [[p + t for p in positions] for t in range(length)]
        self._last = None
        self.replay(self.records(b, length))
        self._last = (b, length)
        logits = self.logits[: b * length].view(length, b, -1).transpose(0, 1)
        divisor = self.model.config.logits_divisor
        return logits if divisor == 1.0 else logits / divisor  # exactly as HybridModel.logits

    def records(self, b: int, length: int) -> torch.Tensor:
        """The records [num_records, RECORD_WORDS] of one step of `length` tokens for rows 0 … b-1 (recorded on
        first use): they read `token_ids` and `positions` token-major and leave the logits in `logits`."""
        records = self._records.get((b, length))
        if records is None:
            records = self._records[(b, length)] = self._record(b, length)
        return records

    def replay(self, records: torch.Tensor) -> None:
        """Run records made over this plan's buffers in one native call; ValueError when one refuses its input."""
        failed = self.lib.decode_plan_run(records.data_ptr(), records.shape[0], torch.get_num_threads())
        if failed:
            raise ValueError(
                f"decode step refused its input at record {failed - 1}: a token id outside [0, "
                f"{self.model.config.vocab_size}), a position outside the KV cache or without a KV block, or a MoE "
                "block's scratch that could not be allocated"
            )
