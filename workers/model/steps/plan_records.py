"""The records a `DecodePlan` replays: op codes and a recorder that turns kernel calls into fixed-size records.

A record is 32 int64 words, as `csrc/decode_plan.c` reads them: the op code, 27 integer or pointer arguments and
4 float arguments stored as doubles. Tensors become their data pointers, so every tensor a record names must stay
alive (and in place) as long as the records do.
"""

from __future__ import annotations

import enum
import struct

import torch

from workers.model.kernels import native, native_bf16
from workers.model.layers.attention import inverse_frequencies
from workers.model.layers.linear import NativeLinear


class Op(enum.IntEnum):
    """Op codes of csrc/decode_plan.c (same values)."""

    EMBED = 1
    RMS_NORM = 2
    ADD_RMS_NORM = 3
    LINEAR = 4
    SILU_MUL = 5
    MAMBA2 = 6
    ATTENTION = 7
    RELU_SQUARE = 8
    ROPE = 9
    COPY = 10
    MAMBA2_SHIFT = 11
    GDN = 12
    GDN_SHIFT = 13
    COPY_ROWS = 14
    SIGMOID_MUL = 15
    ARGMAX_FEED = 16  # the draft chain's (workers/model/steps/draft_chain.py)
    ATTENTION_PADDED = 18  # ATTENTION skipping rows at position -1 (an MTP head's padded catch-up feeds)
    ARGMAX = 19  # logits rows → token ids (int64), torch.argmax's first maximal index
    MAMBA2_VERIFY = 20
    GDN_VERIFY = 21
    ATTENTION_VERIFY = 22
    LINEAR_INT8 = 23  # int8 panels with per-output scales (quantization="int8_weight_only")
    LINEAR_BF16 = 24  # bfloat16 panels (dtype="bfloat16" on CPU), with the process's kernel path
    LINEAR_W8A8 = 40  # int8 × int8 panels (quantization="int8", layers/linear_w8a8.py)
    MOE_ROUTE = 41  # router logits → each row's experts and weights (csrc/moe.c)
    MOE_EXPERTS = 42  # the chosen experts' weighted sum per row
    MOE_COMBINE = 43  # routed + (sigmoid-gated) shared MLP output
    MAMBA1_CONV = 50  # Mamba1 (Jamba, steps/mamba1_records.py): conv window step + SiLU over x
    MAMBA1_NORMS = 51  # the dt / B / C RMS norms of x_proj's output
    MAMBA1_SSM = 52  # softplus(dt), the selective state update, D skip, silu(z) gate (decode or verification)
    MAMBA1_SHIFT = 53  # the keep after a verification (decode_plan_shift)
    ADD = 80  # out = x + y elementwise (Zamba2: adapters, the residual stream its shared blocks leave unwritten; the
    # residual before a post-norm or shared block)
    GELU_MUL = 81  # gelu(gate) · up, the erf form (Zamba2's shared MLP)
    SHORT_CONV = 70  # LFM2's gated short conv (csrc/short_conv.c; lfm_olmo_records.py)
    SHORT_CONV_VERIFY = 71
    SHORT_CONV_SHIFT = 72
    REPEAT_HEADS = 73  # LFM3's per-head output gate over each head's channels
    KDA = 57  # Kimi Delta Attention (kimi_records.py)
    KDA_VERIFY = 58
    KDA_SHIFT = 59
    MLA = 64  # latent attention over the cached latent (kimi_records.py)


NUM_INTS, NUM_FLOATS = 27, 4  # a record: code, 27 integers or pointers, 4 floats stored as doubles
RECORD_WORDS = 1 + NUM_INTS + NUM_FLOATS


def _pointer(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if not native.fits(t) and not (
        t.dtype in (torch.int64, torch.int32, torch.int8, torch.bfloat16) and t.is_contiguous()
    ):
        raise ValueError(f"a decode plan needs contiguous CPU tensors, got {t.dtype} on {t.device}")
    return t.data_ptr()


def _double_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def scratch_rows(buffer: torch.Tensor, b: int, width: int) -> torch.Tensor:
    """The first b rows of `width` values of a scratch buffer, as a contiguous [b, width] tensor."""
    return buffer.view(-1)[: b * width].view(b, width)


class Recorder:
    """Collects the records of one step of `length` tokens for `rows` rows."""

    def __init__(self, rows: int, length: int):
        self.rows, self.length = rows, length
        self.records: list[list[int]] = []

    def emit(self, code: Op, ints: list[int | torch.Tensor | None], floats: tuple[float, ...] = ()) -> None:
        """Append a record: tensors become their data pointers (None: a null pointer), floats their double bits."""
        words = [_pointer(v) if v is None or isinstance(v, torch.Tensor) else int(v) for v in ints]
        assert len(words) <= NUM_INTS and len(floats) <= NUM_FLOATS
        doubles = [_double_bits(f) for f in floats]
        self.records.append([code, *words, *[0] * (NUM_INTS - len(words)), *doubles, *[0] * (NUM_FLOATS - len(floats))])

    def linear(self, layer: NativeLinear, x: torch.Tensor, y: torch.Tensor) -> None:
        """y = layer(x) for the native linear `layer`, over all rows · length tokens."""
        self.emit(*linear_record(layer, x, y, self.rows * self.length))

    def tensor(self) -> torch.Tensor:
        """The records as one [num_records, RECORD_WORDS] int64 tensor (what the C side walks)."""
        return torch.tensor(self.records, dtype=torch.int64).view(-1, RECORD_WORDS)


def linear_record(layer: NativeLinear, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple[Op, list]:
    """(op, arguments) of y [rows, out] = layer(x [rows, in]): float32, int8 (`layer.scale` set), int8 × int8
    (a W8A8Linear's `packed`) or bfloat16 (`layer.bf16_path` set) panels."""
    packed = getattr(layer, "packed", None)  # a W8A8Linear's
    if packed is not None:
        return Op.LINEAR_W8A8, [
            x,
            packed.panels,
            packed.scale,
            packed.correction,
            layer.bias,
            y,
            rows,
            layer.out_features,
            layer.in_features,
            packed.group_size,
            layer.float_weight,
            layer.top_k,
        ]
    if getattr(layer, "bf16_path", None) is not None:
        return Op.LINEAR_BF16, [
            x,
            layer.panels,
            layer.bias,
            y,
            rows,
            layer.out_features,
            layer.in_features,
            native_bf16.BF16_PATHS[layer.bf16_path],
        ]
    if layer.scale is not None:
        return Op.LINEAR_INT8, [
            x,
            layer.panels,
            layer.scale,
            layer.bias,
            y,
            rows,
            layer.out_features,
            layer.in_features,
        ]
    return Op.LINEAR, [x, layer.panels, layer.bias, y, rows, layer.out_features, layer.in_features]


def record_attention_inputs(rec: Recorder, attention: torch.nn.Module, scratch: object) -> tuple[torch.Tensor, ...]:
    """The records of an attention block's inputs for all rows · length tokens, as `Attention._project` computes them
    on the native path: the q/k/v projections of `scratch.normed`, the [q_h | gate_h] split of gated attention's
    q_proj rows (into `scratch.query` and `scratch.gate`), the per-head q/k RMSNorms (Qwen3, Qwen3.5, LFM2) or the
    whole-width ones (OLMo) in place.
    `scratch` is a plan with the buffers `normed`, `wide`, `narrow`, `keys`, `values`, `query`, `gate`. Returns
    views q, keys, values and the attention output scratch, each [l, b, ·] (token-major)."""
    a, b, length, n = attention.config, rec.rows, rec.length, rec.rows * rec.length
    width = a.num_heads * a.head_dim
    projected = scratch_rows(scratch.wide, n, attention.q_proj.out_features)
    out = scratch_rows(scratch.narrow, n, width).view(length, b, width)
    keys, values = scratch.keys[:n].view(length, b, -1), scratch.values[:n].view(length, b, -1)
    rec.linear(attention.q_proj, scratch.normed[:n], projected)
    rec.linear(attention.k_proj, scratch.normed[:n], keys.view(n, -1))
    rec.linear(attention.v_proj, scratch.normed[:n], values.view(n, -1))
    if a.output_gate:  # q_proj rows per head are [q_h | gate_h]: split them as `Attention._project` does
        q = scratch.query[:n].view(length, b, width)
        for part, offset in ((q, 0), (scratch.gate[:n], a.head_dim)):
            rec.emit(
                Op.COPY_ROWS,
                [part, projected.view(-1)[offset:], n * a.num_heads, a.head_dim, a.head_dim, 2 * a.head_dim],
            )
    else:
        q = projected.view(length, b, width)
    if attention.q_norm is not None and a.qk_norm_full_width:  # OLMo: one RMSNorm over all heads, in place
        for x, norm in ((q, attention.q_norm), (keys, attention.k_norm)):
            rows = x.reshape(n, -1)
            rec.emit(Op.RMS_NORM, [rows, norm.weight, rows, n, rows.shape[1]], (norm.eps,))
    elif attention.q_norm is not None:  # per-head RMSNorm of q and k, in place, before RoPE
        for x, norm, heads in ((q, attention.q_norm, a.num_heads), (keys, attention.k_norm, a.num_kv_heads)):
            head_rows = x.reshape(n * heads, a.head_dim)
            rec.emit(Op.RMS_NORM, [head_rows, norm.weight, head_rows, n * heads, a.head_dim], (norm.eps,))
    return q, keys, values, out


def record_rope_attention(
    rec: Recorder,
    plan: object,
    config: object,
    layer: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """RoPE (when the attention `config` has it) on each token's q and new keys, then attention of the l tokens of
    each row (each causally up to its own position, the cache read once for them) over the plan's cache layer
    `layer`. q, keys, values, out are token-major ([l, b, ·] or [l · b, ·]: token t of row r at row t · b + r).
    `plan` has `pool`, `slot_ids`, `positions` [l, rows] and `_referenced` (tensors the records point at)."""
    a, b, length = config, rec.rows, rec.length
    if a.rope_theta is not None:
        inv_freq = inverse_frequencies(a.rope_theta, a.rotary_dim, torch.device("cpu"), a.rope_pairs)
        plan._referenced.append(inv_freq)
        for t in range(length):
            positions = plan.positions[t, :b]
            rec.emit(Op.ROPE, [q.view(length, b, -1)[t], positions, inv_freq, b, a.num_heads, a.head_dim, a.rotary_dim])
            rec.emit(
                Op.ROPE, [keys.view(length, b, -1)[t], positions, inv_freq, b, a.num_kv_heads, a.head_dim, a.rotary_dim]
            )
    pool, blocks = plan.pool, plan.pool.blocks
    rec.emit(
        Op.ATTENTION if length == 1 else Op.ATTENTION_VERIFY,
        [
            q,
            keys,
            values,
            pool.key[layer],
            pool.value[layer],
            plan.slot_ids,
            plan.positions[0, :b],
            blocks.tables,
            out,
            b,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            pool.capacity,
            blocks.max_blocks_per_slot,
            blocks.block_size,
            pool.key.shape[2],
            length,
            a.sliding_window or 0,
        ],
        (a.scale,),
    )
