"""The hybrid language model: embeddings, a list of pre-norm residual blocks, final norm, LM head.

Recurrent blocks (Mamba2 or Gated DeltaNet) share one contract: `mixer(x, state, num_tokens, in_place)` →
(out, new state, scan inputs), and `mixer.state_after(state, scan, num_tokens)` for speculative state shifting.

Tensor parallel (`tp.size` T > 1): the model is built from the rank's local config (`shard_config`: its share of
the heads and channels), so the state pools and kernels see local shapes. Every mixer returns a *partial sum* (its
row-parallel output), and `forward` all-reduces each block's output once, here, before the post-norm and the
residual add. The one exception is a Zamba2 shared-block use (SHARED_ATTENTION): its output feeds
`next_norm(hidden + out)` directly, so the use all-reduces inside and returns the full output, which is not reduced
again. Mixers that need a collective in their middle (a Mamba2 gated norm spanning ranks, Mamba1's x_proj) call
the group themselves. The embedding and LM head are vocabulary-parallel (`vocabulary.py`). At T = 1 every collective
is the identity: the same bits as a model without tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.model.checkpoint.config import ATTENTION, MOE, PARALLEL, RECURRENT_KINDS, SHARED_ATTENTION, HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, check_divisible, shard_config, vocab_shard_size
from workers.model.distributed.slices import ShardRule
from workers.model.layers.block import Block
from workers.model.layers.mtp import MtpHead
from workers.model.layers.norm import RMSNorm
from workers.model.layers.shared_block import bind_shared_blocks
from workers.model.layers.vocabulary import VocabParallelEmbedding, gather_logits, vocab_rule
from workers.model.state import DeltaScanInputs, ForwardBatch, KVCache, RecurrentState, ScanInputs


@dataclass
class ForwardOutput:
    """Result of one forward pass."""

    hidden: torch.Tensor  # [b, l, d] final hidden states (after the final norm)
    mamba_states: list[RecurrentState]  # per recurrent layer (Mamba2 or GDN): state after each row's last valid token
    scan_inputs: list[ScanInputs | DeltaScanInputs] = field(default_factory=list)  # per recurrent layer, if asked


class HybridModel(nn.Module):
    """A causal LM over explicit state: `forward` takes recurrent states and KV caches and returns new recurrent states."""

    def __init__(self, config: HybridConfig, mtp: bool = False, tp: TensorParallel = SINGLE_TP):
        """`config`: the whole model's architecture. `mtp`: also build the checkpoint's multi-token-prediction head
        (`self.mtp`, a draft for speculation). `tp`: this rank's place in its tensor-parallel group; the model then
        holds the rank's share (`self.config` is the local config, `self.full_config` the whole one)."""
        super().__init__()
        check_divisible(config, tp.size, tp.expert_parallel)
        self.full_config, self.tp = config, tp
        self.config = config = shard_config(config, tp)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.blocks = nn.ModuleList(
            Block(config, kind, i in config.post_norm_blocks, config.attention_of(i), tp=tp)
            for i, kind in enumerate(config.block_kinds)
        )
        if config.shared_block is not None:  # Zamba2: the uses of its shared transformer blocks share their weights
            bind_shared_blocks(self.blocks, config)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, vocab_shard_size(config.vocab_size, tp), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The MTP head takes `tp` for its shard rules (slice S2b); a single rank's needs none.
        self.mtp = MtpHead(config, tp=tp) if mtp else None

    def shard_rules(self) -> dict[str, ShardRule]:
        """The LM head's vocabulary rows (the embedding states its own; tied, they are the same rows)."""
        return {"lm_head.weight": vocab_rule(self.config.vocab_size, self.tp)}

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        mamba_states: list[RecurrentState] | None,
        kv_caches: list[KVCache],
        keep_scan_inputs: bool = False,
        in_place: bool = False,
        static_shapes: bool = False,
    ) -> ForwardOutput:
        """input_ids [b, l] (right-padded to l) → final hidden states, new recurrent states (and scan inputs).

        `mamba_states` (one per recurrent layer, Mamba2 or GDN) None: every row starts its sequence (zero states;
        prompts, scoring). The new states are those after each row's last valid token; `kv_caches` receive the new
        keys. `in_place` (decode, one token per row): the given state tensors are updated and returned.
        `static_shapes`: attention writes and reads with shapes fixed by the caches' capacity (no host sync, no
        data-dependent shapes: what a CUDA graph captures; see `Attention.forward_static`).
        """
        if keep_scan_inputs and (in_place or mamba_states is None):
            raise ValueError("keep_scan_inputs needs the old states: not with in_place or without states")
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        # Zamba2's shared blocks read the original embeddings (a copy: native residual adds update `hidden` in place).
        embeddings = hidden.clone() if self.config.shared_block is not None else None
        output = ForwardOutput(hidden, [])
        num_recurrent = sum(block.kind in RECURRENT_KINDS for block in self.blocks)
        states = mamba_states if mamba_states is not None else [None] * num_recurrent
        state_iter, kv_iter = iter(states), iter(kv_caches)
        normed = self.blocks[0].norm(hidden) if self.blocks else self.final_norm(hidden)
        next_norms = [block.norm for block in self.blocks[1:]] + [self.final_norm]
        for block, next_norm in zip(self.blocks, next_norms):
            if block.kind in RECURRENT_KINDS:
                # A parallel block (Falcon-H1) also runs attention: it takes the batch and its KV cache too.
                extra = (batch, next(kv_iter), static_shapes) if block.kind == PARALLEL else ()
                out, state, scan = block.mixer(normed, next(state_iter), batch.num_tokens, in_place, *extra)
                output.mamba_states.append(state)
                if keep_scan_inputs:
                    output.scan_inputs.append(scan)
            elif block.kind == ATTENTION:
                attend = block.mixer.forward_static if static_shapes else block.mixer
                out = attend(normed, batch, next(kv_iter))
            elif block.kind == SHARED_ATTENTION:
                # Zamba2: the next (Mamba2) block reads norm(hidden + T); its residual stays `hidden`. The use
                # returns its full output (it all-reduces inside under tensor parallelism), not a partial sum.
                out = block.mixer(hidden, embeddings, batch, next(kv_iter), static_shapes)
                normed = next_norm(hidden + out)
                continue
            elif block.kind == MOE:
                out = block.mixer(normed, static_shapes)
            else:
                out = block.mixer(normed)
            out = self.tp.group.all_reduce_(out)  # the ranks' partial sums (the identity at one rank)
            if block.post_norm is not None:  # OLMo 2/3: the norm follows the mixer
                out = block.post_norm(out)
            # The residual connection, fused with the next block's pre-norm (or the final norm).
            hidden, normed = next_norm.add_and_norm(hidden, out, self.config.residual_multiplier)
        output.hidden = normed
        return output

    def states_after(
        self,
        mamba_states: list[RecurrentState],
        scan_inputs: list[ScanInputs | DeltaScanInputs],
        num_tokens: torch.Tensor,
        static_shapes: bool = False,
    ) -> list[RecurrentState]:
        """Every recurrent layer's state after each row's first `num_tokens` inputs of a kept forward.

        `static_shapes`: never read `num_tokens` on the host (a CUDA graph's form; the same states)."""
        mixers = [block.mixer for block in self.blocks if block.kind in RECURRENT_KINDS]
        return [
            m.state_after(s, scan, num_tokens, static_shapes)
            for m, s, scan in zip(mixers, mamba_states, scan_inputs, strict=True)
        ]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., d] → float32 logits [..., vocab] (the whole vocabulary on every rank)."""
        logits = self.lm_head(hidden).float()
        logits = logits if self.config.logits_divisor == 1.0 else logits / self.config.logits_divisor
        return gather_logits(logits, self.config.vocab_size, self.tp)
