"""Tiny random Kimi-Linear checkpoints, saved with transformers' own `save_pretrained` (outside `tiny_models.FAMILIES`,
which every family-wide test runs).

`kimi_linear`: the published 48B-A3B layout in small — KDA layers with one MLA layer (1-based `full_attn_layers`
[3]), a dense first layer then MoE layers with one shared expert and grouped sigmoid routing (2 groups, best 1).
`kimi_linear_qlora`: MLA first and last, with a low-rank query (`q_lora_rank`), and MoE from layer 2 on.
`kimi_linear_dense`: one KDA and one MLA layer with dense MLPs only.
`kimi_linear_odd`: odd shapes — KDA head_dim 12 (not a multiple of 16) over 3 heads, a 5-wide conv; MLA with
3 heads, no rope part (qk_rope_head_dim 0), odd latent and head widths, a low-rank query.
`kimi_linear_wide`: KDA head_dim 80 (a full 64-column block of the native kernels plus a partial one), MLA latent
72 + rope 16 (the hub checkpoint's 512 + 64 in small), dense MLPs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from tests.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, make_tokenizer, randomise

_KIMI = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    num_local_experts=6,
    n_shared_experts=1,
    routed_scaling_factor=2.0,
    rms_norm_eps=1e-3,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
_LINEAR = dict(head_dim=16, num_heads=2, short_conv_kernel_size=4)

KIMI_FAMILIES = {
    "kimi_linear": lambda: KimiLinearForCausalLM(KimiLinearConfig(
        **_KIMI, q_lora_rank=None, num_hidden_layers=4, first_k_dense_replace=1,
        linear_attn_config=dict(**_LINEAR, kda_layers=[1, 2, 4], full_attn_layers=[3]))),
    "kimi_linear_qlora": lambda: KimiLinearForCausalLM(KimiLinearConfig(
        **_KIMI, q_lora_rank=16, num_hidden_layers=4, first_k_dense_replace=2,
        linear_attn_config=dict(**_LINEAR, kda_layers=[2, 3], full_attn_layers=[1, 4]))),
    # No experts (transformers' `mlp_layer_types`): the layout whose decode steps can run as CUDA graphs.
    "kimi_linear_dense": lambda: KimiLinearForCausalLM(KimiLinearConfig(
        **_KIMI, q_lora_rank=None, num_hidden_layers=2, mlp_layer_types=["dense", "dense"],
        linear_attn_config=dict(**_LINEAR, kda_layers=[1], full_attn_layers=[2]))),
    "kimi_linear_odd": lambda: KimiLinearForCausalLM(KimiLinearConfig(
        **{**_KIMI, "num_attention_heads": 3, "num_key_value_heads": 3, "kv_lora_rank": 19, "qk_rope_head_dim": 0,
           "qk_nope_head_dim": 10, "v_head_dim": 7},
        q_lora_rank=11, num_hidden_layers=3, mlp_layer_types=["dense"] * 3,
        linear_attn_config=dict(head_dim=12, num_heads=3, short_conv_kernel_size=5, kda_layers=[1, 3],
                                full_attn_layers=[2]))),
    "kimi_linear_wide": lambda: KimiLinearForCausalLM(KimiLinearConfig(
        **{**_KIMI, "kv_lora_rank": 72, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32},
        q_lora_rank=None, num_hidden_layers=2, mlp_layer_types=["dense"] * 2,
        linear_attn_config=dict(head_dim=80, num_heads=2, short_conv_kernel_size=4, kda_layers=[1],
                                full_attn_layers=[2]))),
}  # fmt: skip


def build_kimi_checkpoint(family: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Save a tiny random Kimi-Linear `family` model, the tiny tokenizer and a generation config into `directory`."""
    torch.manual_seed(seed)
    model = KIMI_FAMILIES[family]()
    randomise(model, seed)
    model.to(dtype).save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory
