"""A whole-model decode step as one native call: the CPU counterpart of a CUDA graph.

Module by module, a decode step of the bench model makes ~70 kernel calls from Python, and at batch 1 the
interpreter's share (argument checks, output allocation, ctypes) is ~3 ms of a ~17 ms step. A `DecodePlan`
records those same calls once per batch size — weights, state slots 0 … b-1 of a `StatePool`, and scratch
buffers allocated once — and `csrc/decode_plan.c` replays them. Each record calls the kernel the module path would
call with the same arguments, so logits, states and KV caches match that path bit for bit (tests check it).

It covers models whose every block runs native on the module path: Mamba2 with the native decode kernel,
attention (NoPE or RoPE), dense MLPs (SwiGLU or relu²), native linears and norms (CPU, float32). Anything else
(MoE blocks, other dtypes, the torch kernels) keeps the module path; `unsupported_reason` says why.
"""

from __future__ import annotations

import struct

import torch

from workers.model import native
from workers.model.attention import Attention, inverse_frequencies
from workers.model.config import ATTENTION, MAMBA, MLP
from workers.model.feed_forward import MLP as DenseMLP
from workers.model.hybrid import HybridModel
from workers.model.linear import NativeLinear
from workers.model.mamba2 import Mamba2Mixer
from workers.model.state import StatePool

# Op codes of csrc/decode_plan.c.
EMBED, RMS_NORM, ADD_RMS_NORM, LINEAR, SILU_MUL, MAMBA2, ATTENTION_STEP, RELU_SQUARE, ROPE = range(1, 10)
NUM_INTS, NUM_FLOATS = 27, 4  # a record: code, 27 integers or pointers, 4 floats stored as doubles


def unsupported_reason(model: HybridModel) -> str | None:
    """Why `model` cannot run as a decode plan, or None when it can."""
    norms = [block.norm for block in model.blocks] + [model.final_norm]
    if not all(norm.native for norm in norms) or not isinstance(model.lm_head, NativeLinear):
        return "the native kernels are off (not CPU float32, or decode_kernel / linear_backend chose another path)"
    for block in model.blocks:
        mixer = block.mixer
        linears = [m for m in mixer.modules() if isinstance(m, torch.nn.Linear | NativeLinear)]
        if not all(isinstance(m, NativeLinear) for m in linears):
            return f"a {block.kind} block has linears outside the native kernel"
        if block.kind == MAMBA and mixer.decode_kernel != "native":
            return "Mamba2 decode steps do not run through the native kernel"
        if block.kind == ATTENTION and not mixer.native:
            return "attention decode steps do not run through the native kernel"
        if block.kind == MLP and not mixer.native:
            return "MLP activations do not run through the native kernels"
        if block.kind not in (MAMBA, ATTENTION, MLP):
            return f"{block.kind} blocks are not covered"
    return None


def _pointer(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if not native.fits(t) and not (t.dtype == torch.int64 and t.is_contiguous()):
        raise ValueError(f"a decode plan needs contiguous CPU tensors, got {t.dtype} on {t.device}")
    return t.data_ptr()


def _double_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


class DecodePlan:
    """Decode steps of `model` for the requests in slots 0 … b-1 of `pool` (any b up to the pool's slot count)."""

    def __init__(self, model: HybridModel, pool: StatePool):
        """Allocate the step's buffers for every slot of `pool`; records are built per batch size on first use."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"this model cannot run as a decode plan: {reason}")
        self.lib = native.load()
        if self.lib.decode_plan_record_words() != 1 + NUM_INTS + NUM_FLOATS:
            raise native.NativeKernelError("decode_plan.c and decode_plan.py disagree on the record size")
        self.model, self.pool = model, pool
        config = model.config
        rows, d = pool.num_slots, config.hidden_size
        self.max_rows = rows
        linears = [m for block in model.blocks for m in block.mixer.modules() if isinstance(m, NativeLinear)]
        self.token_ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.slot_ids = torch.arange(rows, dtype=torch.int64)
        self.hidden, self.normed, self.mixed = (torch.empty(rows, d) for _ in range(3))
        # Scratch shared by the blocks: in_proj / up_proj / q_proj outputs, and out_proj / down_proj / o_proj inputs.
        self.wide = torch.empty(rows * max([m.out_features for m in linears], default=1))
        self.narrow = torch.empty(rows * max([m.in_features for m in linears], default=1))
        m, a = config.mamba, config.attention
        self.xbc = torch.empty(rows, m.conv_dim if MAMBA in config.block_kinds else 1)
        kv_width = a.num_kv_heads * a.head_dim if ATTENTION in config.block_kinds else 1
        self.keys, self.values = torch.empty(rows, kv_width), torch.empty(rows, kv_width)
        self.scores = torch.empty(rows * a.num_heads * pool.capacity if ATTENTION in config.block_kinds else 1)
        self.logits = torch.empty(rows, config.vocab_size)
        self._records: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # tensors the records point into that nothing else holds

    def run(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One step for rows 0 … b-1: input `token_ids` at `positions` (= tokens already cached) → logits [b, v].

        Updates the pool's Mamba states and KV caches as the module path's in-place decode does. The logits are a
        view of a buffer the next step overwrites.
        """
        b = len(token_ids)
        if not 1 <= b <= self.max_rows or len(positions) != b:
            raise ValueError(
                f"a step needs 1 … {self.max_rows} rows with one position each, got {b} / {len(positions)}"
            )
        self.token_ids.numpy()[:b] = token_ids
        self.positions.numpy()[:b] = positions
        records = self._records.get(b)
        if records is None:
            records = self._records[b] = self._record(b)
        failed = self.lib.decode_plan_run(records.data_ptr(), records.shape[0], torch.get_num_threads())
        if failed:
            raise ValueError(
                f"decode step refused its input at record {failed - 1}: a token id outside [0, "
                f"{self.model.config.vocab_size}) or a position outside the KV cache (capacity {self.pool.capacity})"
            )
        logits = self.logits[:b]
        divisor = self.model.config.logits_divisor
        return logits if divisor == 1.0 else logits / divisor  # exactly as HybridModel.logits

    # ------------------------------------------------------------------------------------------------ recording
    def _record(self, b: int) -> torch.Tensor:
        """The records of one step at batch size b."""
        model, config = self.model, self.model.config
        rec = _Recorder(b)
        d = config.hidden_size
        hidden, normed, mixed = self.hidden[:b], self.normed[:b], self.mixed[:b]
        rec.emit(EMBED, [self.token_ids, model.embed_tokens.weight, hidden, b, d, config.vocab_size],
                 (config.embedding_multiplier,))  # fmt: skip
        first_norm = model.blocks[0].norm if model.blocks else model.final_norm
        rec.emit(RMS_NORM, [hidden, first_norm.weight, normed, b, d], (first_norm.eps,))
        next_norms = [block.norm for block in model.blocks[1:]] + [model.final_norm]
        mamba_layer = attention_layer = 0
        for block, next_norm in zip(model.blocks, next_norms):
            if block.kind == MAMBA:
                self._record_mamba(rec, block.mixer, mamba_layer)
                mamba_layer += 1
            elif block.kind == ATTENTION:
                self._record_attention(rec, block.mixer, attention_layer)
                attention_layer += 1
            else:
                self._record_mlp(rec, block.mixer)
            rec.emit(ADD_RMS_NORM, [hidden, mixed, next_norm.weight, normed, b, d],
                     (config.residual_multiplier, next_norm.eps))  # fmt: skip
        rec.linear(model.lm_head, normed, self.logits[:b])
        return torch.tensor(rec.records, dtype=torch.int64)

    def _record_mamba(self, rec: _Recorder, mixer: Mamba2Mixer, layer: int) -> None:
        m, b = mixer.config, rec.rows
        proj = _rows(self.wide, b, mixer.in_proj.out_features)
        y = _rows(self.narrow, b, m.intermediate_size)
        rec.linear(mixer.in_proj, self.normed[:b], proj)
        rec.emit(MAMBA2, [proj, self.pool.conv[layer], mixer.conv1d.weight, mixer.conv1d.bias, mixer.dt_bias,
                          mixer.A_log, mixer.D, self.pool.ssm[layer], mixer.norm.weight, mixer.norm.num_groups,
                          self.xbc, y, b, m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_kernel],
                 (m.dt_min, m.dt_max, mixer.norm.eps))  # fmt: skip
        rec.linear(mixer.out_proj, y, self.mixed[:b])

    def _record_attention(self, rec: _Recorder, attention: Attention, layer: int) -> None:
        a, b = attention.config, rec.rows
        q = _rows(self.wide, b, a.num_heads * a.head_dim)
        out = _rows(self.narrow, b, a.num_heads * a.head_dim)
        keys, values = self.keys[:b], self.values[:b]
        rec.linear(attention.q_proj, self.normed[:b], q)
        rec.linear(attention.k_proj, self.normed[:b], keys)
        rec.linear(attention.v_proj, self.normed[:b], values)
        if a.rope_theta is not None:
            inv_freq = inverse_frequencies(a.rope_theta, a.rotary_dim, torch.device("cpu"))
            self._keep.append(inv_freq)
            rec.emit(ROPE, [q, self.positions, inv_freq, b, a.num_heads, a.head_dim, a.rotary_dim])
            rec.emit(ROPE, [keys, self.positions, inv_freq, b, a.num_kv_heads, a.head_dim, a.rotary_dim])
        rec.emit(ATTENTION_STEP, [q, keys, values, self.pool.key[layer], self.pool.value[layer], self.slot_ids,
                                  self.positions, self.scores, out, b, a.num_heads, a.num_kv_heads, a.head_dim,
                                  self.pool.capacity], (a.scale,))  # fmt: skip
        rec.linear(attention.o_proj, out, self.mixed[:b])

    def _record_mlp(self, rec: _Recorder, mlp: DenseMLP) -> None:
        b, intermediate = rec.rows, mlp.down_proj.in_features
        h = _rows(self.wide, b, mlp.up_proj.out_features)
        act = _rows(self.narrow, b, intermediate)
        rec.linear(mlp.up_proj, self.normed[:b], h)
        if mlp.gated:
            rec.emit(SILU_MUL, [h, act, b, intermediate])
        else:
            rec.emit(RELU_SQUARE, [h, act, b * intermediate])
        rec.linear(mlp.down_proj, act, self.mixed[:b])


def _rows(buffer: torch.Tensor, b: int, width: int) -> torch.Tensor:
    """The first b rows of `width` values of a scratch buffer, as a contiguous [b, width] tensor."""
    return buffer.view(-1)[: b * width].view(b, width)


class _Recorder:
    """Collects the records of one step at `rows` rows."""

    def __init__(self, rows: int):
        self.rows = rows
        self.records: list[list[int]] = []

    def emit(self, code: int, ints: list[int | torch.Tensor | None], floats: tuple[float, ...] = ()) -> None:
        """Append a record: tensors become their data pointers (None: a null pointer), floats their double bits."""
        words = [_pointer(v) if v is None or isinstance(v, torch.Tensor) else int(v) for v in ints]
        assert len(words) <= NUM_INTS and len(floats) <= NUM_FLOATS
        doubles = [_double_bits(f) for f in floats]
        self.records.append([code, *words, *[0] * (NUM_INTS - len(words)), *doubles, *[0] * (NUM_FLOATS - len(floats))])

    def linear(self, layer: NativeLinear, x: torch.Tensor, y: torch.Tensor) -> None:
        """y = layer(x) for the native linear `layer`."""
        self.emit(LINEAR, [x, layer.panels, layer.bias, y, self.rows, layer.out_features, layer.in_features])
