"""How a `DecodePlan` records one step: the kernel calls of every block, in the order the module path makes them.

`DecodeRecords` is the recording half of `DecodePlan` (`decode_plan.py`, which allocates the buffers these records
point into — `hidden`, `normed`, `mixed`, the `wide` / `narrow` scratch, the kept in_proj outputs — and replays
them). Recurrent layers (Mamba2, Gated DeltaNet), attention, Falcon-H1's parallel blocks and the feed-forward blocks
(`feed_forward_records.py`) each have their records here, Zamba2's shared-block uses in `shared_block_records.py`;
the state shift after a verification too. LFM's short convs, head gates and norms after the mixer (LFM3's sandwich
norms, OLMo's post-norm blocks) are in `lfm_olmo_records.py`, Jamba's Mamba1 mixers in `mamba1_records.py`,
Kimi-Linear's Kimi Delta Attention and latent attention in `kimi_records.py`.
"""

from __future__ import annotations

import torch

from workers.model.checkpoint.config import (
    ATTENTION,
    GDN,
    KDA,
    MAMBA,
    MAMBA1,
    MOE,
    PARALLEL,
    RECURRENT_KINDS,
    SHARED_ATTENTION,
    SHORT_CONV,
)
from workers.model.layers.attention import Attention
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.short_conv import ShortConvMixer
from workers.model.steps.feed_forward_records import record_mlp, record_moe
from workers.model.steps.kimi_records import kda_kept_width, record_kda, record_kda_shift, record_mla
from workers.model.steps.lfm_olmo_records import (
    record_first_norm,
    record_head_gate,
    record_residual,
    record_short_conv,
    record_short_conv_shift,
)
from workers.model.steps.mamba1_records import kept_width as mamba1_kept_width
from workers.model.steps.mamba1_records import record_mamba1, record_mamba1_shift
from workers.model.steps.plan_records import Op, Recorder, record_attention_inputs, record_rope_attention, scratch_rows
from workers.model.steps.shared_block_records import (
    record_embeddings_copy,
    record_shared_block,
)


def branches(block: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(recurrent mixer, attention) of a block: a parallel block (Falcon-H1) has both, others one or neither."""
    if block.kind == PARALLEL:
        return block.mixer.mamba, block.mixer.self_attn
    return (block.mixer if block.kind in RECURRENT_KINDS else None), (block.mixer if block.kind == ATTENTION else None)


def kept_width(mixer: torch.nn.Module) -> int:
    """Floats per token a verification keeps of a recurrent layer for the keep: its in_proj outputs (Mamba1: its
    x_proj and dt_proj outputs too; KDA: f_b_proj's)."""
    if isinstance(mixer, KimiDeltaAttentionMixer):
        return kda_kept_width(mixer)
    return mamba1_kept_width(mixer) if isinstance(mixer, Mamba1Mixer) else mixer.in_proj.out_features


def _mamba2_sizes(m: object) -> list[int]:
    """A Mamba2 record's sizes after the row count: heads, head dim, groups, state size, conv taps."""
    return [m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_kernel]


class DecodeRecords:
    """The records of a decode plan's steps, over the buffers the plan allocated (see the module docstring)."""

    def _record(self, b: int, length: int) -> torch.Tensor:
        """The records of one step of `length` tokens for b rows."""
        model, config = self.model, self.model.config
        n, d = b * length, config.hidden_size
        rec = Recorder(b, length)
        hidden, normed, mixed = self.hidden[:n], self.normed[:n], self.mixed[:n]
        rec.emit(
            Op.EMBED,
            [self.token_ids, model.embed_tokens.weight, hidden, n, d, config.vocab_size],
            (config.embedding_multiplier,),
        )
        record_embeddings_copy(rec, self, n)  # Zamba2's shared blocks read the input embeddings
        record_first_norm(rec, model, hidden, normed)
        next_norms = [block.norm for block in model.blocks[1:]] + [model.final_norm]
        recurrent_layer = attention_layer = 0
        for block, next_norm in zip(model.blocks, next_norms):
            if block.kind == MAMBA:
                self._record_mamba(rec, block.mixer, recurrent_layer)
            elif block.kind == GDN:
                self._record_gdn(rec, block.mixer, recurrent_layer)
            elif block.kind == KDA:
                record_kda(rec, self, block.mixer, recurrent_layer)
            elif isinstance(block.mixer, MultiHeadLatentAttention):
                record_mla(rec, self, block.mixer, attention_layer)
                attention_layer += 1
            elif block.kind == MAMBA1:
                record_mamba1(rec, block.mixer, recurrent_layer, self)
            elif block.kind == SHORT_CONV:
                record_short_conv(rec, block.mixer, self, recurrent_layer)
            elif block.kind == ATTENTION:
                self._record_attention(rec, block.mixer, attention_layer)
                attention_layer += 1
            elif block.kind == PARALLEL:
                self._record_parallel(rec, block, recurrent_layer, attention_layer)
                attention_layer += 1
            elif block.kind == SHARED_ATTENTION:  # Zamba2: writes normed = next_norm(hidden + T), not the residual
                record_shared_block(rec, self, block.mixer, attention_layer, next_norm)
                attention_layer += 1
                continue
            elif block.kind == MOE:
                record_moe(rec, block.mixer, normed, mixed, self.moe_scratch, self.wide, self.narrow)
            else:
                record_mlp(rec, block.mixer, normed, mixed, self.wide, self.narrow)
            recurrent_layer += block.kind in RECURRENT_KINDS
            record_residual(rec, block, next_norm, self, config.residual_multiplier)
        rec.linear(model.lm_head, normed, self.logits[:n])
        return rec.tensor()

    def _projections(self, width: int, layer: int, n: int, length: int) -> torch.Tensor:
        """Where a recurrent layer's in_proj writes [l, b, width]: kept per layer through a verification (the shift
        re-runs tokens from it), else scratch."""
        if length > 1:
            return self.kept_proj[layer, : n * width].view(length, n // length, width)
        return scratch_rows(self.wide, n, width).view(1, n, width)

    def _record_mamba(self, rec: Recorder, mixer: Mamba2Mixer, layer: int) -> None:
        m, b, length, n = mixer.config, rec.rows, rec.length, rec.rows * rec.length
        width = mixer.in_proj.out_features
        proj = self._projections(width, layer, n, length)
        y = scratch_rows(self.narrow, n, m.intermediate_size).view(length, b, m.intermediate_size)
        rec.linear(mixer.in_proj, self.normed[:n], proj.view(n, width))
        # A decode step updates the states in place; a verification reads them and leaves them for `keep`.
        rec.emit(
            Op.MAMBA2 if length == 1 else Op.MAMBA2_VERIFY,
            [
                proj,
                *self._mamba2_arguments(mixer, layer),
                mixer.norm.weight,
                mixer.norm.num_groups,
                self.xbc[:n],
                y,
                b,
                *_mamba2_sizes(m),
                length,
            ],
            (m.dt_min, m.dt_max, mixer.norm.eps),
        )
        rec.linear(mixer.out_proj, y.view(n, m.intermediate_size), self.mixed[:n])

    def _mamba2_arguments(self, mixer: Mamba2Mixer, layer: int) -> list[torch.Tensor | None]:
        """OP_MAMBA2's / OP_MAMBA2_SHIFT's arguments from the conv window to the SSM states (what
        `Mamba2Mixer._native_decode` hands `mamba2_decode_step`)."""
        conv, ssm = self.pool.conv[layer], self.pool.ssm[layer]
        return [conv, mixer.conv1d.weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, mixer.D, ssm]

    def _gdn_arguments(self, mixer: GatedDeltaNetMixer, layer: int) -> list[torch.Tensor]:
        """OP_GDN's arguments from the conv window to the delta-rule states: what
        `GatedDeltaNetMixer._native_decode` hands `gdn_decode_step` (the conv weight [conv_dim, 1, W] is the
        [conv_dim, W] it squeezes)."""
        return [self.pool.conv[layer], mixer.conv1d.weight, mixer.dt_bias, mixer.A_log, self.pool.ssm[layer]]

    def _record_gdn(self, rec: Recorder, mixer: GatedDeltaNetMixer, layer: int) -> None:
        g, b, length, n = mixer.config, rec.rows, rec.length, rec.rows * rec.length
        width = mixer.in_proj.out_features  # rows [q | k | v | z | b | a]: the loader joined the projections
        proj = self._projections(width, layer, n, length)
        y = scratch_rows(self.narrow, n, g.value_dim).view(length, b, g.value_dim)
        rec.linear(mixer.in_proj, self.normed[:n], proj.view(n, width))
        sizes = [g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel]
        # A decode step updates the states in place; a verification reads them and leaves them for `keep`.
        rec.emit(
            Op.GDN if length == 1 else Op.GDN_VERIFY,
            [proj, *self._gdn_arguments(mixer, layer), mixer.norm.weight, self.xbc[:n], y, b, *sizes, length],
            (mixer.norm.eps, g.beta_scale),
        )
        rec.linear(mixer.out_proj, y.view(n, g.value_dim), self.mixed[:n])

    def _record_shift(self, b: int, length: int) -> torch.Tensor:
        """One shift record per recurrent layer: advance the states the verification left by each row's accepted
        tokens, from the layer's kept in_proj outputs (the keep kernels of csrc/mamba_decode.c, gdn_decode.c)."""
        rec = Recorder(b, length)
        mixers = [branches(block)[0] for block in self.model.blocks if block.kind in RECURRENT_KINDS]
        for layer, mixer in enumerate(mixers):
            if isinstance(mixer, KimiDeltaAttentionMixer):
                record_kda_shift(rec, self, mixer, layer)
                continue
            if isinstance(mixer, Mamba1Mixer):
                record_mamba1_shift(rec, mixer, layer, self)
                continue
            kept, scratch = self.kept_proj[layer, : b * length * mixer.in_proj.out_features], self.xbc[: b * length]
            if isinstance(mixer, ShortConvMixer):
                record_short_conv_shift(rec, mixer, self, layer)
                continue
            if isinstance(mixer, GatedDeltaNetMixer):
                g = mixer.config
                sizes = [g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel]
                rec.emit(
                    Op.GDN_SHIFT,
                    [kept, *self._gdn_arguments(mixer, layer), scratch, b, *sizes, length],
                    (g.beta_scale,),
                )
                continue
            m = mixer.config
            rec.emit(
                Op.MAMBA2_SHIFT,
                [kept, *self._mamba2_arguments(mixer, layer), scratch, b, *_mamba2_sizes(m), length],
                (m.dt_min, m.dt_max),
            )
        return rec.tensor()

    def _record_parallel(
        self, rec: Recorder, block: torch.nn.Module, recurrent_layer: int, attention_layer: int
    ) -> None:
        """Falcon-H1's block: the Mamba2 branch into `mixed`, the attention branch (reading the same `normed`) into
        `branch`, then mixed += branch — ADD_RMS_NORM with α = 1 adds exactly as the module path's `out + attention`
        does; the norm it also computes goes to scratch."""
        n, d = rec.rows * rec.length, self.model.config.hidden_size
        self._record_mamba(rec, block.mixer.mamba, recurrent_layer)
        self._record_attention(rec, block.mixer.self_attn, attention_layer, self.branch[:n])
        rec.emit(
            Op.ADD_RMS_NORM,
            [self.mixed[:n], self.branch[:n], block.norm.weight, self.branch_normed[:n], n, d],
            (1.0, block.norm.eps),
        )

    def _record_attention(
        self, rec: Recorder, attention: Attention, layer: int, into: torch.Tensor | None = None
    ) -> None:
        """An attention block's records; its o_proj writes `into` (default: `mixed`)."""
        a, n = attention.config, rec.rows * rec.length
        width = a.num_heads * a.head_dim
        q, keys, values, out = record_attention_inputs(rec, attention, self)
        record_rope_attention(rec, self, a, layer, q, keys, values, out)
        if a.output_gate:  # out · sigmoid(gate), the kernel `Attention._output` calls on the native path
            rec.emit(Op.SIGMOID_MUL, [out, self.gate[:n], out, n, width])
        if attention.g_proj is not None:  # LFM3's one gate per head
            record_head_gate(rec, attention, self, out.view(n, width))
        rec.linear(attention.o_proj, out.view(n, width), self.mixed[:n] if into is None else into)
