"""Tiny random Zamba2 checkpoints, saved with transformers' own `save_pretrained` (kept out of `FAMILIES`, which every
family-wide test runs).

Two layouts between them cover the published checkpoints' options:
- "zamba2_abab" (Zamba2-2.7B-like): two shared blocks used round-robin (uses 0 and 2 share block 0), no attention
  adapters, no RoPE, one B/C group, no linear biases;
- "zamba2_lora" (Zamba2-1.2B / 7B-like): attention adapters on q, k, v, RoPE in the shared attention, two B/C groups,
  `add_bias_linear`, and a hybrid first layer.

Weights are `tiny_models.randomise`d, then scaled by 0.7: through Zamba2's chain of shared blocks the family-wide
scale amplifies float32 rounding so much that transformers' own float32 and float64 logprobs differ by up to 8e-4
(measured over three seeds); at 0.7× they differ by ≤ 1.1e-5, well below the 1e-4 the comparison checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Zamba2Config, Zamba2ForCausalLM

from tests.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, make_tokenizer, randomise

SCALE = 0.7
H, M = "hybrid", "mamba"
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_mamba_heads=4,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    chunk_size=16,
    intermediate_size=96,
    adapter_rank=8,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    max_position_embeddings=512,
)
ZAMBA2_LAYOUTS = {
    "zamba2_abab": dict(layers_block_type=[M, H, M, H, M, H, M], num_mem_blocks=2),
    "zamba2_lora": dict(layers_block_type=[H, M, H, M, H], num_mem_blocks=2, use_shared_attention_adapter=True,
                        use_mem_rope=True, rope_theta=500.0, mamba_ngroups=2, add_bias_linear=True),
}  # fmt: skip


def build_zamba2(name: str, directory: Path, seed: int = 0) -> Path:
    """Save the tiny Zamba2 `name` (a key of ZAMBA2_LAYOUTS), its tokenizer and a generation config."""
    torch.manual_seed(seed)
    layout = ZAMBA2_LAYOUTS[name]
    model = Zamba2ForCausalLM(Zamba2Config(**_COMMON, **layout, num_hidden_layers=len(layout["layers_block_type"])))
    randomise(model, seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(SCALE)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


def copy_shared_weights_to_every_use(path: Path) -> None:
    """Rewrite a checkpoint as some hub uploads store it: every hybrid layer carries a full copy of its shared
    block's `shared_transformer.*` tensors (transformers saves them under each block's first layer only)."""
    config = json.loads((path.parent / "config.json").read_text())
    hybrid = [i for i, kind in enumerate(config["layers_block_type"]) if kind == "hybrid"]
    tensors = load_file(path)
    num_blocks = config["num_mem_blocks"]
    for use, layer in enumerate(hybrid[num_blocks:], start=num_blocks):
        source = f"model.layers.{hybrid[use % num_blocks]}.shared_transformer."
        for key in [k for k in tensors if k.startswith(source)]:
            tensors[f"model.layers.{layer}.shared_transformer.{key[len(source) :]}"] = tensors[key].clone()
    save_file(tensors, path, metadata={"format": "pt"})
