"""Bench-size presets of the families beyond GraniteMoeHybrid, Qwen3.5, LFM2 and Falcon-H1 (`bench/generation.py`).

Each is its family's layout at the "bench" size — hidden 512, 8 layers, MLP 1536, vocab 32000, tied embeddings,
float32 — saved with transformers' own config and model classes, so hybridgen and transformers load the same
checkpoint. What each keeps of the family's published layout:
- "jamba-bench": Mamba1 (state 16, conv 4, d_inner 1024, dt_rank 32) with attention at layers 3 and 7 (Jamba's
  1 : 7), and a MoE of 8 full-width experts, top 2, in every other layer (Jamba's `expert_layer_period` 2).
- "zamba2-bench": Mamba2 (16 heads × 64, state 128, the "bench" mixer) in every layer; two shared transformer
  blocks (attention over the 1024-wide [hidden, embeddings], gated-GELU MLP 1536) used before layers 2 and 6,
  alternating, with the attention adapters Zamba2-1.2B has.
- "kimi-bench": Kimi Delta Attention (4 heads × 128, conv 4) with latent attention at layers 3 and 7 (Kimi-Linear's
  3 : 1 at this depth, 8 heads, latent 128, no-RoPE part 64 + RoPE part 32, values 64), a dense first layer and
  grouped-sigmoid MoE elsewhere (32 experts of 256, top 4, one shared expert: active width 1280).
- "olmo-bench": OLMo-Hybrid's Gated DeltaNet (4 key heads, 8 value heads of 128, β = 2·sigmoid) with post-norm
  attention at layers 3 and 7 (its 3 : 1), no RoPE (the released layout).
- "lfm3-bench": LFM3's layer pattern (conv, conv, full, conv, sliding, conv, full, conv; 3-tap short convs), a
  sliding window of 512, sandwich norms, 8 heads / 4 KV heads of 64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_BENCH = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_M, _H = "mamba", "hybrid"
# name → (transformers config class, model class, config keywords)
FAMILY_PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "jamba-bench": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            **_BENCH,
            num_attention_heads=8,
            num_key_value_heads=4,
            attn_layer_period=4,
            attn_layer_offset=3,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=8,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
    ),
    "zamba2-bench": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            **_BENCH,
            layers_block_type=[_M, _M, _H, _M, _M, _M, _H, _M],
            num_attention_heads=8,
            num_key_value_heads=8,
            n_mamba_heads=16,
            mamba_d_state=128,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_ngroups=1,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=128,
            use_mem_rope=False,
        ),
    ),
    "kimi-bench": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            **_BENCH,
            moe_intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=None,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            mlp_layer_types=["dense"] + ["sparse"] * 7,
            linear_head_dim=128,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        ),
    ),
    "olmo-bench": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            **_BENCH,
            num_attention_heads=8,
            num_key_value_heads=4,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            rope_parameters={"rope_theta": None, "rope_type": "default"},
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        ),
    ),
    "lfm3-bench": (
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            **_BENCH,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            conv_L_cache=3,
            sliding_window=512,
            layer_types=[
                "conv",
                "conv",
                "full_attention",
                "conv",
                "sliding_attention",
                "conv",
                "full_attention",
                "conv",
            ],
        ),
    ),
}


def save_random_model(model_class: type, config: Any, directory: Path, dtype: str = "float32") -> Path:
    """Save `model_class(config)` with seed-0 random weights in `dtype` into `directory` (`save_pretrained`): what
    every bench preset's checkpoint is."""
    torch.manual_seed(0)
    model_class(config).to(getattr(torch, dtype)).save_pretrained(directory)
    return directory


def build_family_preset(name: str, directory: Path) -> Path:
    """Save a random-weight checkpoint of the family preset `name` into `directory` (transformers' own classes)."""
    import transformers

    config_class, model_class, shape = FAMILY_PRESETS[name]
    return save_random_model(
        getattr(transformers, model_class), getattr(transformers, config_class)(**shape), directory
    )
