"""Tiny random Falcon-H1 checkpoints in the layouts the published ones use, saved with transformers' own
`save_pretrained` (kept out of `tiny_models.FAMILIES`, which every family-wide test runs).

- `falcon_h1`: gated RMSNorm in the mixer, norm after the gate (`mamba_rms_norm` true, `mamba_norm_before_gate`
  false: Falcon-H1-1.5B/3B/7B/34B as their configs say), 2 B/C groups, head_dim ≠ hidden / heads, untied.
- `falcon_h1_no_norm`: no norm in the mixer, y · silu(z) (`mamba_rms_norm` false: Falcon-H1-0.5B), `mamba_d_ssm`
  from `mamba_expand`, `mamba_d_head` "auto", tied embeddings (Falcon-H1-Tiny).
- `falcon_h1_biases`: norm before the gate, every bias on (attention, MLP, in_proj, projectors), no conv bias.

Every μP multiplier differs from 1 (and from the others), so a multiplier applied in the wrong place shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

from tests.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, make_tokenizer, random_value

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=96,
    num_hidden_layers=3,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    mamba_n_heads=4,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    rope_theta=10000.0,
)
_MULTIPLIERS = dict(
    embedding_multiplier=2.5,
    lm_head_multiplier=0.6,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.7,
    key_multiplier=0.45,
    ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.55,
    ssm_multipliers=[0.9, 1.2, 0.6, 1.4, 0.8],
    mlp_multipliers=[1.5, 0.65],
)

FALCON_H1_FAMILIES = {
    "falcon_h1": dict(**_COMMON, **_MULTIPLIERS, mamba_d_ssm=128, mamba_d_head=32, mamba_n_groups=2,
                      mamba_rms_norm=True, mamba_norm_before_gate=False, tie_word_embeddings=False),
    "falcon_h1_no_norm": dict(**_COMMON, **_MULTIPLIERS, mamba_d_ssm=None, mamba_expand=2, mamba_d_head="auto",
                              mamba_n_groups=1, mamba_rms_norm=False, tie_word_embeddings=True),
    "falcon_h1_biases": dict(**_COMMON, **_MULTIPLIERS, mamba_d_ssm=64, mamba_d_head=16, mamba_n_groups=2,
                             mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True, mlp_bias=True,
                             mamba_proj_bias=True, projectors_bias=True, mamba_conv_bias=False,
                             tie_word_embeddings=False),
}  # fmt: skip


def build_falcon_h1(family: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny random Falcon-H1 `family` model, the tiny tokenizer and a generation config into `directory`.

    Parameters get the large-scale values of `tiny_models.random_value`; buffers (the μP vector transformers derives
    from the config, RoPE tables) keep their values."""
    torch.manual_seed(seed)
    model = FalconH1ForCausalLM(FalconH1Config(**FALCON_H1_FAMILIES[family]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_value(name, param.shape, generator, False))
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory
