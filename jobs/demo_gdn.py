"""The GDN demo model of `jobs/train_demo.py`: a small Qwen3.5-style Gated DeltaNet hybrid with an MTP head.

Shapes follow Qwen3.5-0.8B scaled to the demo pair's size (hidden 256, 6 layers, linear/full attention 2:1, key and
value heads of equal count, gated attention with partial RoPE 0.25, tied embeddings). It is saved in the text-only
form (`qwen3_5_text`, weights under `model.*`): transformers keeps our byte-level tokenizer for that model type,
while for `qwen3_5` it substitutes its own pre-tokenizer.

transformers builds no MTP head (it ignores `mtp.*`), so `MtpHead` here is one, built from transformers' own
Qwen3.5 modules and named as Qwen3.5 checkpoints name theirs: `mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a full-attention decoder layer), `mtp.norm`. At position t it reads
the final-norm hidden state h_t and token t+1 and predicts token t+2 (the formula `workers/model/layers/mtp.py` serves).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

GDN_SHAPES: dict[str, Any] = dict(
    hidden_size=256,
    num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    intermediate_size=768,
)
MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's λ for the MTP loss early in training


def gdn_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> Any:
    """The demo GDN model's `Qwen3_5TextConfig` (tied embeddings, RoPE on a quarter of each head)."""
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2], "mrope_interleaved": True}  # fmt: skip
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_parameters=rope,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=eos_token_id,
        **GDN_SHAPES,
    )
    config.mtp_num_hidden_layers = 1  # as Qwen3.5 checkpoints declare their head (transformers does not read it)
    return config


class MtpHead(nn.Module):
    """Qwen3.5's MTP layer out of transformers' modules; `state_dict()` keys are the checkpoint's minus `mtp.`."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(d, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(d, eps=config.rms_norm_eps)
        full_attention = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, full_attention)])
        self.norm = Qwen3_5RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, model: Any, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [b, l] (tokens t+1), hidden [b, l, d] (h_t at positions 0 … l-1) → logits [b, l, vocab]
        predicting tokens t+2; `model` is the `Qwen3_5ForCausalLM` whose embedding and lm_head it shares."""
        embedded = self.pre_fc_norm_embedding(model.model.embed_tokens(next_ids))
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        # attention_mask None: transformers' SDPA path then runs causal attention.
        x = self.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions)
        return model.lm_head(self.norm(x))


def build(config: Any) -> tuple[Any, MtpHead]:
    """A freshly initialised (model, MTP head): the head goes through transformers' `_init_weights` like the trunk
    (normal linears, zero-centred norms at 0, i.e. scale 1)."""
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM(config)
    head = MtpHead(config)
    head.apply(model._init_weights)
    return model, head


def losses(model: Any, head: MtpHead, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss) on a batch x [b, l]: the MTP at position t sees h_t and x[t+1], targets x[t+2]."""
    out = model.model(input_ids=x)
    hidden = out.last_hidden_state  # [b, l, d], after the final norm
    logits = model.lm_head(hidden)
    vocab = logits.shape[-1]
    main = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
    mtp_logits = head(model, x[:, 1:-1], hidden[:, :-2])
    mtp = nn.functional.cross_entropy(mtp_logits.reshape(-1, vocab), x[:, 2:].reshape(-1))
    return main, mtp


def mtp_tensors(head: MtpHead) -> dict[str, torch.Tensor]:
    """The head's weights under their checkpoint names (`mtp.*`), contiguous, ready for safetensors."""
    return {f"mtp.{name}": tensor.detach().contiguous() for name, tensor in head.state_dict().items()}
