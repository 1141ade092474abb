"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 checkpoints (`mtp.*` weights), as a draft.

At position t it reads the target's final-norm hidden state h_t and the next token t+1 and predicts token t+2:
    x = fc(cat[pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(h_t)])   (embedding first)
    x = x + attention(norm(x));  x = x + feed_forward(norm(x))                         (one full-attention layer)
    out = norm(x);  logits = lm_head(out)                                              (the target's lm_head)
Chaining feeds `out` back as the next h with the drafted token. The layer's KV cache is indexed by position t
(vLLM's convention: the drafter's positions are the target positions of the hidden states it reads).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.attention import Attention
from workers.model.config import HybridConfig
from workers.model.feed_forward import MLP, MoE
from workers.model.norm import RMSNorm
from workers.model.state import ForwardBatch, KVCache


class MtpHead(nn.Module):
    """One MTP layer; embedding and LM head are the target's (passed to `forward` / applied by the caller)."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        d, eps, ff = config.hidden_size, config.rms_norm_eps, config.feed_forward
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(d, eps)
        self.pre_fc_norm_hidden = RMSNorm(d, eps)
        self.attention_norm = RMSNorm(d, eps)
        self.attention = Attention(config)
        self.feed_forward_norm = RMSNorm(d, eps)
        if ff.num_experts:
            self.feed_forward: nn.Module = MoE(config)
        else:
            self.feed_forward = MLP(d, ff.intermediate_size, ff.gated, ff.bias)
        self.norm = RMSNorm(d, eps)

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        embed_tokens: nn.Embedding,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """token_ids [b, l] (tokens t+1), hidden [b, l, d] (h_t) → out [b, l, d] (normed; logits via lm_head).

        `batch.cache_lens` is each row's first position t; the layer's keys/values are written at t … t+l-1.
        """
        embedded = self.pre_fc_norm_embedding(embed_tokens(token_ids))
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = x + self.attention(self.attention_norm(x), batch, cache)
        x = x + self.feed_forward(self.feed_forward_norm(x))
        return self.norm(x)
