"""Tiny random Jamba checkpoints, saved with transformers' own `save_pretrained` (kept out of `tiny_models.FAMILIES`,
whose every family-wide test would otherwise run them too).

Two layouts between them cover what the published checkpoints use:
- `jamba_moe` (Jamba-v0.1 / 1.5 style): MoE every 2nd layer from layer 1, attention every 3rd from layer 1, so one
  layer has attention + MoE and others Mamba + MoE, attention + MLP, Mamba + MLP; GQA; dt_rank "auto".
- `jamba_dense` (Jamba Reasoning 3B style): a single expert (dense MLPs only), MQA, tied embeddings; plus the
  rarer flags: in/out projection biases, no conv bias, a 3-tap conv and an explicit dt_rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import JambaConfig, JambaForCausalLM

from tests.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, fuse_experts, make_tokenizer, random_value

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=48,
    num_attention_heads=4,
    mamba_d_state=16,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    max_position_embeddings=512,
)

JAMBA_FAMILIES = {
    "jamba_moe": lambda: JambaConfig(
        **_COMMON, num_hidden_layers=6, num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2),
    "jamba_dense": lambda: JambaConfig(
        **_COMMON, num_hidden_layers=4, num_key_value_heads=1, attn_layer_period=4, attn_layer_offset=2,
        num_experts=1, num_experts_per_tok=1, tie_word_embeddings=True, mamba_proj_bias=True,
        mamba_conv_bias=False, mamba_d_conv=3, mamba_dt_rank=6),
}  # fmt: skip


def randomise_jamba(model: torch.nn.Module, seed: int) -> None:
    """`tiny_models.random_value` weights (std 0.15, conv 0.5, norms near 1, A_log in log[1, 8], D ±0.5), with the
    dt bias lowered by 2: at softplus(dt) ~ 0.7 float32 rounding grew to 2.4e-4 in transformers' own log-probs
    (against float64) over six layers; at ~0.2 it stays near 2e-5 while the state keeps a longer memory."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            value = random_value(name, tensor.shape, generator, zero_centred_norms=False)
            tensor.copy_(value - 2.0 if name.endswith("dt_proj.bias") else value)


def build_jamba_checkpoint(
    family: str, directory: Path, seed: int = 0, fused_experts: bool = False, perturb: float = 0.0
) -> Path:
    """Save a tiny random Jamba `family` model, the tiny tokenizer and a generation config into `directory`.
    `fused_experts`: store the experts as `experts.gate_up_proj` / `experts.down_proj` instead of per expert.
    `perturb`: add noise of this std to every weight (a draft close to, but not equal to, the unperturbed model)."""
    torch.manual_seed(seed)
    model = JambaForCausalLM(JAMBA_FAMILIES[family]())
    randomise_jamba(model, seed)
    if perturb:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for tensor in model.parameters():
                tensor.add_(perturb * torch.randn(tensor.shape, generator=generator))
    model.save_pretrained(directory)
    if fused_experts:
        fuse_experts(directory / "model.safetensors")
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


def load_oracle(directory: Path, dtype: torch.dtype = torch.float64) -> JambaForCausalLM:
    """transformers' Jamba from `directory` (the oracle); float64 needs the eager experts (grouped_mm is float32+)."""
    return JambaForCausalLM.from_pretrained(directory, dtype=dtype, experts_implementation="eager").eval()
