"""Tiny random LFM2 / LFM2-MoE / LFM3 checkpoints, saved with transformers' own `save_pretrained`.

Outside `tests/tiny_models.FAMILIES` (which every family-wide test runs): the LFM tests build these themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    Lfm2Config,
    Lfm2ForCausalLM,
    Lfm2MoeConfig,
    Lfm2MoeForCausalLM,
    Lfm3Config,
    Lfm3ForCausalLM,
)

from tests.tiny_models import BOS, EOS, PAD, VOCAB_SIZE, make_tokenizer, random_value

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    max_position_embeddings=512,
)

LFM_FAMILIES = {
    # LFM2 as the hub spells it: `full_attn_idxs`, `block_ff_dim` auto-adjusted (2/3 · 144 · 1.5 → 144), tied.
    "lfm2": lambda: Lfm2ForCausalLM(Lfm2Config(
        **_COMMON, num_hidden_layers=4, full_attn_idxs=[1, 3], block_ff_dim=144, block_ffn_dim_multiplier=1.5,
        block_multiple_of=16, conv_L_cache=3)),
    # `layer_types`, an untied head, no MLP adjustment, conv biases, a longer conv.
    "lfm2_untied": lambda: Lfm2ForCausalLM(Lfm2Config(
        **_COMMON, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], intermediate_size=80,
        block_auto_adjust_ff_dim=False, tie_word_embeddings=False, conv_bias=True, conv_L_cache=4)),
    "lfm2_moe": lambda: Lfm2MoeForCausalLM(Lfm2MoeConfig(
        **_COMMON, num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], intermediate_size=96,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
        routed_scaling_factor=1.5)),
    # LFM3's default layout over 6 layers: conv, conv, full, conv, sliding, conv; a window of 8.
    "lfm3": lambda: Lfm3ForCausalLM(Lfm3Config(
        **_COMMON, num_hidden_layers=6, head_dim=16, intermediate_size=96, sliding_window=8)),
}  # fmt: skip


def randomise_lfm(model: torch.nn.Module, seed: int) -> None:
    """Large-scale random weights (`tests.tiny_models.random_value`; the short conv's taps at std 0.5)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            value = random_value(name.replace("conv.conv.", "conv1d."), tensor.shape, generator, False)
            tensor.copy_(value * 4 if name.endswith("expert_bias") else value)


def build_lfm_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny random LFM `family` model, the tiny tokenizer and a generation config into `directory`."""
    torch.manual_seed(seed)
    model = LFM_FAMILIES[family]()
    randomise_lfm(model, seed)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


@pytest.fixture(scope="session")
def lfm_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """LFM family name → path of its tiny checkpoint directory (built on first use, once per session)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_lfm_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get
