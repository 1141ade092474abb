"""The `config.json` fields of published checkpoints that the preflight's sizing is checked on (no weights needed).

Written without network access, from the design's table (`/work/design41.md` §7.3) and the hub pages as recalled:
no commit could be pinned (`COMMIT` says so). Fields marked `# unsure` are the ones not certain; the sizing test
checks the parameter totals the fields give against the sizes in the models' names (80B, 397B, 56B), which is the
check that the shape fields are right. Fields that do not change any size (rope scaling, token ids, the vision tower
of Qwen3.5, which the loader ignores) are left out.
"""

from __future__ import annotations

import copy
from typing import Any

COMMIT = "not pinned: written offline from the hub config.json as recalled (check against the repo before relying)"

# Qwen/Qwen3-Next-80B-A3B-Instruct (the -Thinking repo has the same shapes).
QWEN3_NEXT_80B_REPO = "Qwen/Qwen3-Next-80B-A3B-Instruct"
QWEN3_NEXT_80B: dict[str, Any] = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,  # 12 full attention, 36 Gated DeltaNet layers
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "intermediate_size": 5120,  # unused: every layer is MoE (decoder_sparse_step 1, no mlp_only_layers)
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "attention_bias": False,
    "mtp_num_hidden_layers": 1,
    "torch_dtype": "bfloat16",
}

# Qwen/Qwen3-Next-80B-A3B-Instruct-FP8: the same model plus its block-wise FP8 quantization_config.
QWEN3_NEXT_80B_FP8_REPO = "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8"
QWEN3_NEXT_80B_FP8: dict[str, Any] = {
    **copy.deepcopy(QWEN3_NEXT_80B),
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        # unsure: the hub lists these per layer ("model.layers.N.mlp.gate", …); one entry per kind is what sizing
        # reads. Whether the GDN's small `in_proj_ba` is listed is the one entry not certain (it changes 0.9 GB).
        "modules_to_not_convert": [
            "lm_head",
            "model.embed_tokens",
            "model.layers.0.mlp.gate",
            "model.layers.0.mlp.shared_expert_gate",
        ],
    },
}

# Qwen/Qwen3.5-397B-A17B: a vision-language wrapper; the language model's fields are its text_config.
QWEN3_5_397B_REPO = "Qwen/Qwen3.5-397B-A17B"
QWEN3_5_397B: dict[str, Any] = {
    "model_type": "qwen3_5_moe",
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 4096,
        "num_hidden_layers": 60,
        "full_attention_interval": 4,  # 15 full attention, 45 Gated DeltaNet layers
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rope_theta": 10000000,  # unsure
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "attention_bias": False,
        "mtp_num_hidden_layers": 1,
        "torch_dtype": "bfloat16",
    },
}

QWEN3_5_397B_FP8_REPO = "Qwen/Qwen3.5-397B-A17B-FP8"
QWEN3_5_397B_FP8: dict[str, Any] = {
    **copy.deepcopy(QWEN3_5_397B),
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": [
            "lm_head",
            "model.language_model.embed_tokens",
            "model.language_model.layers.0.mlp.gate",
            "model.language_model.layers.0.mlp.shared_expert_gate",
        ],  # unsure, as above
    },
}

# nvidia/Nemotron-H-56B-Base-8K: 118 layers, 54 Mamba2 (M), 54 squared-ReLU MLP (-), 10 attention (*). The order of
# the pattern below is not the published one (unsure); sizing depends only on the counts, which are.
NEMOTRON_H_56B_REPO = "nvidia/Nemotron-H-56B-Base-8K"
NEMOTRON_H_56B: dict[str, Any] = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "hybrid_override_pattern": "M-" * 49 + "M*-" * 5 + "*" * 5,
    "hidden_size": 8192,
    "num_hidden_layers": 118,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 256,
    "mamba_head_dim": 64,
    "ssm_state_size": 256,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_hidden_act": "silu",
    "intermediate_size": 32768,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "attention_bias": False,
    "vocab_size": 131072,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "bfloat16",
}

PUBLISHED = {
    QWEN3_NEXT_80B_REPO: QWEN3_NEXT_80B,
    QWEN3_NEXT_80B_FP8_REPO: QWEN3_NEXT_80B_FP8,
    QWEN3_5_397B_REPO: QWEN3_5_397B,
    QWEN3_5_397B_FP8_REPO: QWEN3_5_397B_FP8,
    NEMOTRON_H_56B_REPO: NEMOTRON_H_56B,
}
