"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 and Nemotron-H checkpoints, as a draft.

At position t it reads the target's final-norm hidden state h_t and the next token t+1 and predicts token t+2:
    x = fc(cat[norm_e(embed(token t+1)), norm_h(h_t)])     (embedding first; the target's embedding)
    x = x + mixer_i(norm_i(x))  for each block i of the layer (attention, MLP or MoE; a pre-norm residual block)
    out = norm(x);  logits = lm_head(out)                  (the target's lm_head)
Qwen names them `mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}` around one decoder layer
`mtp.layers.0` (attention, then MLP or MoE). Nemotron-H names them `mtp.layers.0.{eh_proj, enorm, hnorm}` and
`mtp.layers.{last}.final_layernorm`, one block per `mtp.layers.i` in the order of the MTP pattern (e.g. "*E").
Chaining feeds `out` back as the next h with the drafted token. Each attention block's KV cache is indexed by
position t (vLLM's convention: the drafter's positions are the target positions of the hidden states it reads).
Tensor parallel (`tp`, built from the rank's local config): fc and the pre-fc norms are whole on every rank (their
inputs are), the blocks are split by the same rules as the model's, and each block's partial output is all-reduced
before its residual add; the embedding and LM head are the model's vocabulary-parallel ones.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.checkpoint.config import ATTENTION, GDN, MAMBA, MLP, MOE, RECURRENT_KINDS, HybridConfig
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.layers.block import Block
from workers.model.layers.norm import RMSNorm
from workers.model.state import ForwardBatch, KVCache

_PATTERN_CHARS = {MAMBA: "M", GDN: "M", ATTENTION: "*", MLP: "-", MOE: "E"}


def mtp_pattern(config: HybridConfig) -> str:
    """The MTP layer's blocks as a Nemotron-H pattern string (M recurrent, * attention, - MLP, E MoE)."""
    return "".join(_PATTERN_CHARS[kind] for kind in config.mtp_block_kinds)


def check_mtp_layout(config: HybridConfig) -> None:
    """`ValueError` for MTP layouts the proposer cannot serve exactly: a recurrent block (its state would need the
    per-position shifting the proposer does not keep), more than one MTP layer, or no block at all."""
    pattern = mtp_pattern(config)
    if not config.mtp_block_kinds or any(kind in RECURRENT_KINDS for kind in config.mtp_block_kinds):
        raise ValueError(
            f"the {config.model_type} MTP pattern {pattern!r} is not supported: speculative method 'mtp' serves MTP "
            "layers of attention (*), MLP (-) and MoE (E) blocks; a recurrent (M) block would need its own "
            "per-position state, which the MTP proposer does not keep"
        )
    if config.mtp_num_layers != 1:
        raise ValueError(
            f"the {config.model_type} checkpoint declares {config.mtp_num_layers} MTP layers; speculative method "
            "'mtp' serves exactly one (as vLLM does), chained k times"
        )


class MtpHead(nn.Module):
    """One MTP layer; embedding and LM head are the target's (passed to `forward` / applied by the caller)."""

    def __init__(self, config: HybridConfig, tp: TensorParallel = SINGLE_TP):
        """`config`: the rank's local config (`shard_config`); `tp`: its place in the group."""
        super().__init__()
        check_mtp_layout(config)
        self.tp = tp
        d, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(d, eps)
        self.pre_fc_norm_hidden = RMSNorm(d, eps)
        self.blocks = nn.ModuleList(Block(config, kind, tp=tp) for kind in config.mtp_block_kinds)
        self.norm = RMSNorm(d, eps)

    @property
    def num_attention_blocks(self) -> int:
        """How many KV caches `forward` takes: one per attention block."""
        return sum(block.kind == ATTENTION for block in self.blocks)

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        embed_tokens: nn.Embedding,
        batch: ForwardBatch,
        caches: list[KVCache],
    ) -> torch.Tensor:
        """token_ids [b, l] (tokens t+1), hidden [b, l, d] (h_t) → out [b, l, d] (normed; logits via lm_head).

        `batch.cache_lens` is each row's first position t; each attention block writes its keys/values at
        t … t+l-1 of its own cache in `caches` (one per attention block, in block order).
        """
        embedded = self.pre_fc_norm_embedding(embed_tokens(token_ids))
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cache_iter = iter(caches)
        for block in self.blocks:
            normed = block.norm(x)
            out = block.mixer(normed, batch, next(cache_iter)) if block.kind == ATTENTION else block.mixer(normed)
            x = x + self.tp.group.all_reduce_(out)  # a block's output is this rank's partial sum
        return self.norm(x)
