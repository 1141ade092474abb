"""Tiny random OLMo-Hybrid checkpoints (transformers' `OlmoHybridForCausalLM`, saved with `save_pretrained`), kept out
of `tests/tiny_models.FAMILIES` so that the family-wide tests do not multiply.

Layouts: the released one (NoPE, beta in (0, 2)), RoPE with beta in (0, 1), and the hub's own key names (OLMo-core's
`attention_layer_norm` / `feedforward_layer_norm`, `q/k/v_conv1d` of q / k / v widths) where transformers saves
the fused conv as three equal chunks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

from tests.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, make_tokenizer, randomise

# Value heads = 2 × key heads (repeat_interleave matters), d_v ≠ d_k, attention in the middle (a post-norm layer
# between pre-norm ones), GQA. rms_norm_eps 1e-3 keeps float32 rounding well below the 1e-4 comparison.
_OLMO = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-3,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    max_position_embeddings=512,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)

OLMO_HYBRID_FAMILIES = {
    # The released layout: no RoPE (rope_theta null), linear_allow_neg_eigval true.
    "olmo_hybrid": lambda: OlmoHybridConfig(**_OLMO, rope_parameters={"rope_theta": None, "rope_type": "default"}),
    # RoPE on the attention layers, beta in (0, 1), attention biases, the default layer pattern.
    "olmo_hybrid_rope": lambda: OlmoHybridConfig(**{**_OLMO, "layer_types": None}, linear_allow_neg_eigval=False,
                                                 attention_bias=True, rope_parameters={"rope_theta": 500.0}),
}  # fmt: skip


def to_hub_layout(path: Path, config: OlmoHybridConfig) -> None:
    """Rewrite a transformers-saved checkpoint with the hub's q/k/v conv widths (transformers 5.25 saves the fused
    conv as three equal chunks) and OLMo-core's pre-norm names on the Gated DeltaNet layers only."""
    tensors = load_file(path)
    widths = [config.linear_num_key_heads * config.linear_key_head_dim] * 2
    widths.append(config.linear_num_value_heads * config.linear_value_head_dim)
    for layer, layer_type in enumerate(config.layer_types):
        prefix = f"model.layers.{layer}"
        if layer_type == "linear_attention":
            convs = [tensors.pop(f"{prefix}.linear_attn.{p}_conv1d.weight") for p in "qkv"]
            for p, conv in zip("qkv", torch.cat(convs).split(widths)):
                tensors[f"{prefix}.linear_attn.{p}_conv1d.weight"] = conv.contiguous()
        else:  # transformers renames the attention layer's post-attention norm too; the hub keeps OLMo 3's name
            tensors[f"{prefix}.post_attention_layernorm.weight"] = tensors.pop(
                f"{prefix}.feedforward_layer_norm.weight"
            )
    save_file(tensors, path, metadata={"format": "pt"})


def build_olmo_hybrid(name: str, directory: Path, seed: int = 0, hub_layout: bool = False) -> Path:
    """Save the tiny `name` model (re-randomised at a large scale), its tokenizer and a generation config."""
    torch.manual_seed(seed)
    config = OLMO_HYBRID_FAMILIES[name]()
    model = OlmoHybridForCausalLM(config)
    randomise(model, seed)
    model.save_pretrained(directory)
    if hub_layout:
        to_hub_layout(directory / "model.safetensors", config)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory
