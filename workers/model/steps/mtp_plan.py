"""The MTP head's draft steps as native calls: the decode plan (`decode_plan.py`) for `MtpHead` + the LM head.

Module by module, one head step is ~40 kernel calls from Python (fc over cat[enorm(embed), hnorm(h)], each block's
norm and mixer, the final norm, the target's lm_head): on the demo Qwen3.5 model about as long as a whole target
decode step, so that drafting k tokens cost k target steps. An `MtpPlan` records those calls once per shape over the
proposer's KV caches and preallocated buffers, and `csrc/decode_plan.c` replays them:

- a catch-up feed: l positions (h_t, token t+1) per row, then the logits at each row's last one. Rows with fewer
  positions are padded *in front*, so that every row's last position is the feed's last token; padded positions
  run through the linears and norms as garbage rows and are skipped by attention (OP_ATTENTION_PADDED: no KV
  write). Attention runs token by token (the decode kernel), the linears once over all l · b rows;
- a chained step s: the head's own output of step s − 1 and token d_s, one position per row;
- for greedy rows, the whole chain in one call: the feed, then argmax (OP_ARGMAX, torch.argmax's first maximal
  index) into the next step's token, k − 1 times.

Every record calls the kernel the module path calls with the same arguments, so a feed of l positions equals l
`MtpHead.forward` calls of one position each (the decode form: `one_token_each`) + `model.logits`, and a chained
step equals the proposer's module-path step, bit for bit (tests compare logits with `torch.equal`, and the KV).
The module path's multi-position forward attends with PyTorch's SDPA instead (another summation order), as the
target's verification does on the module path. Covered: attention (NoPE or partial RoPE, the gated attention of
Qwen3.5 / Qwen3-Next with q/k norms), dense MLPs (SwiGLU or relu²) with native linears and norms, logits without
a divisor, and MoE blocks (`feed_forward_records.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from workers.model.checkpoint.config import ATTENTION, MLP, MOE
from workers.model.kernels import native
from workers.model.layers.attention import Attention, inverse_frequencies
from workers.model.layers.fp8_experts import Fp8Experts
from workers.model.layers.fp8_linear import FP8_KEPT_REASON, Fp8BlockLinear
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.linear import NativeLinear
from workers.model.state import KVCache
from workers.model.steps.decode_plan import TENSOR_PARALLEL_REASON
from workers.model.steps.feed_forward_records import MoeScratch, moe_unsupported_reason, record_mlp, record_moe
from workers.model.steps.plan_records import (
    RECORD_WORDS,
    Op,
    Recorder,
    linear_record,
    record_attention_inputs,
)

PADDING_POSITION = -1  # a feed position that is padding (OP_ATTENTION_PADDED skips it)


def unsupported_reason(model: HybridModel) -> str | None:
    """Why `model`'s MTP head cannot run as an MTP plan, or None when it can."""
    head = model.mtp
    if head is None:
        return "the model has no MTP head"
    if model.tp.parallel:
        return TENSOR_PARALLEL_REASON
    if any(isinstance(m, (Fp8BlockLinear, Fp8Experts)) for m in [*head.modules(), model.lm_head]):
        return FP8_KEPT_REASON
    norms = [head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm, *(block.norm for block in head.blocks)]
    linears = [head.fc, model.lm_head, *(m for b in head.blocks for m in b.mixer.modules() if _is_linear(m))]
    if not all(norm.native for norm in norms) or not all(isinstance(m, NativeLinear) for m in linears):
        return "the native kernels are off (not CPU float32, or decode_kernel / linear_backend chose another path)"
    if not native.fits(model.embed_tokens.weight):
        return "the embedding is not a contiguous float32 CPU table"
    if model.config.logits_divisor != 1.0:
        return "the logits are scaled (the in-call argmax would compare values the module path never computes)"
    for block in head.blocks:
        if block.kind not in (ATTENTION, MLP, MOE):
            return f"{block.kind} blocks of the MTP head are not covered"
        mixer = block.mixer
        if block.kind == MOE:
            if (reason := moe_unsupported_reason(mixer)) is not None:
                return reason
            continue
        if block.kind == ATTENTION:
            head_norms = [norm for norm in (mixer.q_norm, mixer.k_norm) if norm is not None]
            if not (mixer.native and all(norm.native for norm in head_norms)):
                return "attention decode steps do not run through the native kernel"
        elif not mixer.native:
            return "MLP activations do not run through the native kernels"
    return None


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear | NativeLinear)


def _linear(rec: Recorder, layer: NativeLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    """y [m, out] = layer(x [m, in]) for however many rows x has."""
    rec.emit(*linear_record(layer, x, y, x.shape[0]))


class MtpPlan:
    """Draft steps of `model.mtp` for up to `max_rows` rows over the head's KV `caches` (one per attention block).

    Catch-up feeds take up to `tokens_per_row` positions per row; chains up to `num_steps` drafts. Rows may sit in
    any slots of the caches' block table. Results are views of buffers the next call overwrites.
    """

    def __init__(self, model: HybridModel, caches: list[KVCache], max_rows: int, tokens_per_row: int, num_steps: int):
        """Allocate the buffers; records are built per shape on first use."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"this MTP head cannot run as a plan: {reason}")
        self.lib = native.load()
        if self.lib.decode_plan_record_words() != RECORD_WORDS:
            raise native.NativeKernelError("decode_plan.c and plan_records.py disagree on the record size")
        self.model, self.head, self.caches = model, model.mtp, caches
        self.max_rows, self.tokens_per_row, self.num_steps = max_rows, tokens_per_row, num_steps
        config, rows, d = model.config, max_rows, model.config.hidden_size
        tokens = rows * tokens_per_row
        # A feed, token-major as [l, b] (token t of row r is entry t · b + r): token ids t+1, positions t, h_t.
        self.feed_token_ids = torch.zeros(tokens, dtype=torch.int64)
        self.feed_positions = torch.zeros(tokens, dtype=torch.int64)
        self.feed_hidden = torch.zeros(tokens, d)
        self.slot_ids = torch.zeros(rows, dtype=torch.int64)
        # The chain: draft_ids[s] = d_{s+1} (step s + 1's input token), positions[s] = where step s + 1 writes.
        self.draft_ids = torch.zeros(num_steps, rows, dtype=torch.int64)
        self.chain_positions = torch.zeros(num_steps, rows, dtype=torch.int64)
        self.out = torch.zeros(num_steps, rows, d)  # [k, b, d] the head's normed output of each step
        self.logits = torch.zeros(num_steps, rows, config.vocab_size)  # [k, b, v]
        # Scratch over the rows of one step (at most b · l).
        self.embedded, self.hidden_normed, self.x, self.normed, self.mixed = (torch.zeros(tokens, d) for _ in range(5))
        self.joined = torch.zeros(tokens, 2 * d)  # fc's input cat[enorm(embed), hnorm(h)]
        linears = [m for block in self.head.blocks for m in block.mixer.modules() if isinstance(m, NativeLinear)]
        self.wide = torch.zeros(tokens * max(m.out_features for m in linears))
        self.narrow = torch.zeros(tokens * max(m.in_features for m in linears))
        self.moe_scratch = MoeScratch([b.mixer for b in self.head.blocks if b.kind == MOE], tokens, d)
        a = config.attention
        self.keys, self.values = (torch.zeros(tokens, a.num_kv_heads * a.head_dim) for _ in range(2))
        self.query, self.gate = (torch.zeros(tokens, a.num_heads * a.head_dim) for _ in range(2))
        self.inv_freq = (
            None if a.rope_theta is None else inverse_frequencies(a.rope_theta, a.rotary_dim, torch.device("cpu"))
        )
        # numpy views of the host inputs filled every call (a tensor's .numpy() costs ~5 µs a call)
        self._ids_np, self._positions_np = self.feed_token_ids.numpy(), self.feed_positions.numpy()
        self._slots_np, self._drafts_np = self.slot_ids.numpy(), self.draft_ids.numpy()
        self._chain_np, self._step_offsets = self.chain_positions.numpy(), np.arange(num_steps)[:, None]
        self._records: dict[tuple, torch.Tensor] = {}
        self._shape: tuple[int, int] | None = None  # (b, l) of the staged feed (l = 0: a staged output instead)

    # ------------------------------------------------------------------------------------------------- staging
    def stage_feed(
        self, slots: list[int], starts: list[int], token_ids: list[list[int]], hiddens: list[list[torch.Tensor]]
    ) -> None:
        """Stage a catch-up: row i feeds positions starts[i] … starts[i] + c_i − 1 of slot slots[i], with the tokens
        t+1 `token_ids[i]` (c_i of them) and the hidden states h_t [c_i, d] in the pieces `hiddens[i]`."""
        b, length = len(slots), max(len(ids) for ids in token_ids)
        if not 1 <= b <= self.max_rows or not 1 <= length <= self.tokens_per_row:
            raise ValueError(f"a feed takes 1 … {self.max_rows} rows of at most {self.tokens_per_row} positions")
        ids = self._ids_np[: b * length].reshape(length, b)
        positions = self._positions_np[: b * length].reshape(length, b)
        hidden = self.feed_hidden[: b * length].view(length, b, -1)
        ids.fill(0)
        positions.fill(PADDING_POSITION)
        for row, (start, row_ids, pieces) in enumerate(zip(starts, token_ids, hiddens)):
            first = length - len(row_ids)  # padding in front: every row's last position is token l − 1
            ids[first:, row] = row_ids
            positions[first:, row] = range(start, start + len(row_ids))
            for piece in pieces:
                hidden[first : first + piece.shape[0], row] = piece
                first += piece.shape[0]
        self._stage(slots, [s + len(t) for s, t in zip(starts, token_ids)], length)

    def stage_output(self, slots: list[int], out: torch.Tensor, positions: list[int]) -> None:
        """Stage a chain that starts from a catch-up run elsewhere (module by module): its output [b, d] at the
        rows' last fed positions; row i's first chained step writes at positions[i]. `feed` then only applies the
        LM head."""
        self.out[0, : len(slots)] = out
        self._stage(slots, positions, 0)

    def _stage(self, slots: list[int], chain_starts: list[int], length: int) -> None:
        """Slots, and where each chained step writes: step s + 1 of row i at chain_starts[i] + s."""
        b = len(slots)
        self._slots_np[:b] = slots
        np.add(self._step_offsets, chain_starts, out=self._chain_np[:, :b])
        self._shape = (b, length)

    # ------------------------------------------------------------------------------------------------- running
    def feed(self) -> torch.Tensor:
        """Run the staged feed → logits [b, v] at each row's last position (step 0's, for d_1)."""
        b, length = self._staged()
        self._run(("feed", b, length), lambda: self._record_feed(b, length))
        return self.logits[0, :b]

    def step(self, step: int, token_ids: list[int]) -> torch.Tensor:
        """Chained step `step` (1 … num_steps − 1): the previous step's output with tokens d_step `token_ids` →
        logits [b, v] (for d_{step+1})."""
        b, _ = self._staged()
        if not 1 <= step < self.num_steps or len(token_ids) != b:
            raise ValueError(f"step must be 1 … {self.num_steps - 1} with one token per row, got {step}")
        self._drafts_np[step - 1, :b] = token_ids
        self._run(("step", b, step), lambda: self._record_step(b, step))
        return self.logits[step, :b]

    def greedy(self, num_steps: int) -> torch.Tensor:
        """Greedy drafts [num_steps, b] (a view) in one call: the staged feed, then steps 1 … num_steps − 1, each
        row's argmax feeding the next step. `logits[s, :b]` keeps each step's logits."""
        b, length = self._staged()
        if not 1 <= num_steps <= self.num_steps:
            raise ValueError(f"num_steps must be 1 … {self.num_steps}, got {num_steps}")
        self._run(("greedy", b, length, num_steps), lambda: self._record_greedy(b, length, num_steps))
        return self.draft_ids[:num_steps, :b]

    def _staged(self) -> tuple[int, int]:
        if self._shape is None:
            raise RuntimeError("stage_feed() or stage_output() must come first")
        return self._shape

    def _run(self, key: tuple, record: Callable[[], torch.Tensor]) -> None:
        """Replay the records of `key` (built by `record` on first use)."""
        records = self._records.get(key)
        if records is None:
            records = self._records[key] = record()
        failed = self.lib.decode_plan_run(records.data_ptr(), records.shape[0], torch.get_num_threads())
        if failed:
            raise ValueError(
                f"MTP step refused its input at record {failed - 1}: a token id outside [0, "
                f"{self.model.config.vocab_size}), a position outside the KV cache or without a KV block, or a MoE "
                "block's scratch that could not be allocated"
            )

    # ------------------------------------------------------------------------------------------------ recording
    def _record_greedy(self, b: int, length: int, num_steps: int) -> torch.Tensor:
        """feed, argmax → d_1, then (step s, argmax → d_{s+1}) for s = 1 … num_steps − 1."""
        parts = [self._record_feed(b, length), self._record_argmax(b, 0)]
        for step in range(1, num_steps):
            parts += [self._record_step(b, step), self._record_argmax(b, step)]
        return torch.cat(parts)

    def _record_argmax(self, b: int, step: int) -> torch.Tensor:
        rec = Recorder(b, 1)
        rec.emit(Op.ARGMAX, [self.logits[step, :b], self.draft_ids[step, :b], b, self.model.config.vocab_size])
        return rec.tensor()

    def _record_feed(self, b: int, length: int) -> torch.Tensor:
        """The head over l positions per row, then the LM head at each row's last (l = 0: the LM head alone)."""
        n = b * length
        rec = Recorder(b, length)
        if length:
            self._record_input(rec, self.feed_token_ids[:n], self.feed_hidden[:n])
            positions = self.feed_positions[:n].view(length, b)
            self._record_layer(rec, list(positions), Op.ATTENTION_PADDED, self.out[0, :b])
        _linear(rec, self.model.lm_head, self.out[0, :b], self.logits[0, :b])
        return rec.tensor()

    def _record_step(self, b: int, step: int) -> torch.Tensor:
        rec = Recorder(b, 1)
        self._record_input(rec, self.draft_ids[step - 1, :b], self.out[step - 1, :b])
        self._record_layer(rec, [self.chain_positions[step - 1, :b]], Op.ATTENTION, self.out[step, :b])
        _linear(rec, self.model.lm_head, self.out[step, :b], self.logits[step, :b])
        return rec.tensor()

    def _record_input(self, rec: Recorder, token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """x = fc(cat[enorm(embed(token_ids)), hnorm(hidden)]) over n = b · l rows (the head's embedding lookup has
        no multiplier)."""
        head, config = self.head, self.model.config
        n, d = hidden.shape
        rec.emit(
            Op.EMBED, [token_ids, self.model.embed_tokens.weight, self.embedded[:n], n, d, config.vocab_size], (1.0,)
        )
        for norm, x, normed, offset in (
            (head.pre_fc_norm_embedding, self.embedded, self.normed, 0),
            (head.pre_fc_norm_hidden, hidden, self.hidden_normed, d),
        ):
            rec.emit(Op.RMS_NORM, [x[:n], norm.weight, normed[:n], n, d], (norm.eps,))
            rec.emit(Op.COPY_ROWS, [self.joined.view(-1)[offset:], normed[:n], n, d, 2 * d, d])
        _linear(rec, head.fc, self.joined[:n], self.x[:n])

    def _record_layer(self, rec: Recorder, positions: list[torch.Tensor], attention_op: Op, out: torch.Tensor) -> None:
        """The blocks over x [n, d] (attention token by token at positions[t] [b]), then the last block's residual
        and the head's norm at the last token's b rows only → out [b, d] (the other rows' outputs are unused)."""
        b, length, d = rec.rows, rec.length, self.model.config.hidden_size
        n, blocks, caches = b * length, self.head.blocks, iter(self.caches)
        x, normed, mixed = self.x[:n], self.normed[:n], self.mixed[:n]
        rec.emit(Op.RMS_NORM, [x, blocks[0].norm.weight, normed, n, d], (blocks[0].norm.eps,))
        for i, block in enumerate(blocks):
            if block.kind == ATTENTION:
                self._record_attention(rec, block.mixer, next(caches), positions, attention_op)
            elif block.kind == MOE:
                record_moe(rec, block.mixer, normed, mixed, self.moe_scratch, self.wide, self.narrow)
            else:
                record_mlp(rec, block.mixer, normed, mixed, self.wide, self.narrow)
            if i + 1 < len(blocks):  # the module path's x + mixer(normed), then the next block's norm
                norm = blocks[i + 1].norm
                rec.emit(Op.ADD_RMS_NORM, [x, mixed, norm.weight, normed, n, d], (1.0, norm.eps))
        last, norm = slice(n - b, n), self.head.norm
        rec.emit(Op.ADD_RMS_NORM, [x[last], mixed[last], norm.weight, out, b, d], (1.0, norm.eps))

    def _record_attention(
        self, rec: Recorder, attention: Attention, cache: KVCache, positions: list[torch.Tensor], op: Op
    ) -> None:
        """What `Attention._decode` calls on the native path, for l tokens one after the other (the decode plan's
        `_record_attention` over a standalone cache whose rows may sit in any slots)."""
        a, b, length = attention.config, rec.rows, rec.length
        n, width = b * length, a.num_heads * a.head_dim
        q, keys, values, out = record_attention_inputs(rec, attention, self)
        blocks = cache.blocks
        capacity = blocks.max_blocks_per_slot * blocks.block_size
        for t in range(length):  # token t attends to the cache up to its own position: causal
            if self.inv_freq is not None:
                for x, heads in ((q[t], a.num_heads), (keys[t], a.num_kv_heads)):
                    rec.emit(Op.ROPE, [x, positions[t], self.inv_freq, b, heads, a.head_dim, a.rotary_dim])
            rec.emit(
                op,
                [
                    q[t],
                    keys[t],
                    values[t],
                    cache.key,
                    cache.value,
                    self.slot_ids,
                    positions[t],
                    blocks.tables,
                    out[t],
                    b,
                    a.num_heads,
                    a.num_kv_heads,
                    a.head_dim,
                    capacity,
                    blocks.max_blocks_per_slot,
                    blocks.block_size,
                    cache.key.shape[1],
                ],
                (a.scale,),
            )
        if a.output_gate:  # out · sigmoid(gate), the kernel `Attention._output` calls on the native path
            rec.emit(Op.SIGMOID_MUL, [out, self.gate[:n], out, n, width])
        _linear(rec, attention.o_proj, out.view(n, width), self.mixed[:n])
