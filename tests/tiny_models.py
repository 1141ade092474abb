"""Tiny random checkpoints of every supported family, saved with transformers' own `save_pretrained`.

Weights are re-randomised to a large scale (NOTES.md §5): at the default 0.02 init the recurrent path barely
moves the logits, and a wrong state would still "match".
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

VOCAB_SIZE = 128
PAD, BOS, EOS = 0, 1, 2
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "big", "red", "hello", "world", "."]
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant : {% endif %}"
)

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
_IBM_MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
)
_NEMOTRON = dict(
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    chunk_size=16,
    conv_kernel=4,
    intermediate_size=96,
)

# Gated DeltaNet hybrids: value heads = 2 × key heads (repeat_interleave matters), partial RoPE (0.25 of 32 dims).
# rms_norm_eps 1e-3, not 1e-6: with random weights some heads' delta-rule outputs are ~1e-4, and the gated norm
# then amplifies float32 rounding up to 1/sqrt(eps) — transformers itself moved by 2-3e-4 in logprob between
# float32 and float64 at 1e-6 (measured), which would drown a 1e-4 comparison in rounding noise.
_QWEN = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-3,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_hidden_layers=4,
    max_position_embeddings=512,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)

FAMILIES = {
    "granite_dense": lambda: GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **_COMMON, **_IBM_MAMBA, layer_types=["mamba", "mamba", "attention", "mamba"], num_hidden_layers=4,
        num_local_experts=0, shared_intermediate_size=96, intermediate_size=48, tie_word_embeddings=True,
        embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)),
    "granite_moe": lambda: GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **_COMMON, **_IBM_MAMBA, layer_types=["mamba", "attention", "mamba", "mamba"], num_hidden_layers=4,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, intermediate_size=48,
        position_embedding_type="rope", tie_word_embeddings=False)),
    "bamba": lambda: BambaForCausalLM(BambaConfig(
        **_COMMON, **_IBM_MAMBA, num_hidden_layers=4, attn_layer_indices=[2], intermediate_size=96)),
    "nemotron_dense": lambda: NemotronHForCausalLM(NemotronHConfig(
        **_COMMON, **_NEMOTRON, hybrid_override_pattern="M-*-M-", n_routed_experts=4, num_experts_per_tok=2,
        num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*-*-")),
    "nemotron_moe": lambda: NemotronHForCausalLM(NemotronHConfig(
        **_COMMON, **_NEMOTRON, hybrid_override_pattern="ME*EM-", n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")),
    "qwen3_next": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **_QWEN, **_QWEN_MOE, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_5": lambda: Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=dict(**_QWEN, intermediate_size=96), vision_config=_VISION, tie_word_embeddings=True)),
    "qwen3_5_moe": lambda: Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=dict(**_QWEN, **_QWEN_MOE), vision_config=_VISION)),
}  # fmt: skip
# More dense Gated DeltaNet layouts, outside FAMILIES (which every family-wide test runs): the text-only Qwen3.5
# checkpoint (`qwen3_5_text`, `model.*` keys, untied) and Qwen3-Next without experts (grouped `in_proj_qkvz`).
GDN_VARIANT_FAMILIES = {
    "qwen3_5_text": lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_QWEN, intermediate_size=96)),
    "qwen3_next_dense": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(**_QWEN, intermediate_size=96, num_experts=0)),
    # Wide heads (d_k 40, d_v 72): the native kernels walk a head's state in register blocks of 64 columns, here
    # one full block and a partial one (the real checkpoints' 128 is two full ones).
    "qwen3_5_wide": lambda: Qwen3_5ForCausalLM(
        Qwen3_5TextConfig(**{**_QWEN, "linear_key_head_dim": 40, "linear_value_head_dim": 72}, intermediate_size=96)
    ),
}
# Nemotron 3's latent MoE: the experts run on latent_in(x) (24 wide) and their sum is projected back; outside
# FAMILIES (the MoE tests run it).
MOE_VARIANT_FAMILIES = {
    "nemotron_latent_moe": lambda: NemotronHForCausalLM(
        NemotronHConfig(
            **_COMMON,
            **_NEMOTRON,
            hybrid_override_pattern="ME*EM-",
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            moe_latent_size=24,
        )
    ),
}
# Saved with the hub's fused expert tensors instead of transformers' per-expert keys.
FUSED_EXPERT_FAMILIES = ("qwen3_5_moe",)
# Nemotron-H with an MTP head: "*E" as Nemotron 3 Super declares it, and two attention blocks with relu² MLPs.
NEMOTRON_MTP_FAMILIES = ("nemotron_dense", "nemotron_moe")
# Zero-centred norms and an MTP head; the Qwen3.5 ones also a byte-level tokenizer (transformers loads qwen3_5
# tokenizers as its own byte-level class, which would mangle the word-level one).
QWEN_GDN_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
BYTE_LEVEL_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text")


def draft_for(target: str, draft: str) -> str:
    """The fixture name of `draft` built with `target`'s tokenizer."""
    return f"{draft}+bpe" if target in BYTE_LEVEL_FAMILIES and draft not in BYTE_LEVEL_FAMILIES else draft


# Small draft models with the same vocabulary: one without any recurrent layer, one hybrid.
DRAFT_FAMILIES = {
    "draft_attention": lambda: GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **{**_COMMON, "hidden_size": 32}, **{**_IBM_MAMBA, "mamba_d_head": 16}, layer_types=["attention", "attention"], num_hidden_layers=2,
        num_local_experts=0, shared_intermediate_size=64, position_embedding_type="rope", tie_word_embeddings=True)),
    "draft_hybrid": lambda: BambaForCausalLM(BambaConfig(
        **{**_COMMON, "hidden_size": 32}, **{**_IBM_MAMBA, "mamba_d_head": 16}, num_hidden_layers=2,
        attn_layer_indices=[1], intermediate_size=48)),
}  # fmt: skip


# Attention-only standard models with the same vocabulary (drafts for the hybrids, and plain targets).
_DENSE = dict(**{**_COMMON, "hidden_size": 32}, head_dim=8, intermediate_size=48, num_hidden_layers=2)
DENSE_FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_DENSE, attention_bias=True, rope_theta=500.0)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_DENSE, sliding_window=64)),  # max_model_len 64
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_DENSE, tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_DENSE)),
    "granite": lambda: GraniteForCausalLM(GraniteConfig(
        **_DENSE, embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)),
}  # fmt: skip


def random_value(name: str, shape: torch.Size, generator: torch.Generator, zero_centred_norms: bool) -> torch.Tensor:
    """A large-scale random value for the parameter `name`: std 0.15 (conv 0.5), norms near 1 (near 0 when
    `zero_centred_norms`, but for the Gated DeltaNet's own `linear_attn.norm`), varied A, dt bias, D and score bias."""
    if name.endswith("A_log"):
        return torch.log(1 + 7 * torch.rand(shape, generator=generator))
    randn = torch.randn(shape, generator=generator)
    if name.endswith("dt_bias"):
        return -1 + randn * 0.5
    if name.endswith(".D") or "e_score_correction_bias" in name:
        return randn * 0.5
    if "norm" in name:
        return (0.0 if zero_centred_norms and "linear_attn.norm" not in name else 1.0) + 0.2 * randn
    return randn * (0.5 if "conv1d" in name else 0.15)


def randomise(model: torch.nn.Module, seed: int, zero_centred_norms: bool = False) -> None:
    """Large-scale random weights (`random_value`). `zero_centred_norms` (Qwen): RMSNorms scale by 1 + w."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" not in name:
                tensor.copy_(random_value(name, tensor.shape, generator, zero_centred_norms))


def add_nemotron_mtp_head(config: NemotronHConfig, path: Path, seed: int) -> None:
    """Add random `mtp.*` weights as Nemotron-H checkpoints ship them (transformers builds no MTP head): block i of
    the MTP pattern is `mtp.layers.i.{norm, mixer.*}` with the keys and shapes of a backbone layer of its kind
    (experts per expert); layer 0 also holds `enorm`, `hnorm` [d] and `eh_proj` [d, 2d], the last layer
    `final_layernorm` [d]."""
    generator = torch.Generator().manual_seed(seed + 3)
    tensors = load_file(path)
    pattern, d = config.mtp_hybrid_override_pattern, config.hidden_size
    head = {"mtp.layers.0.enorm.weight": (d,), "mtp.layers.0.hnorm.weight": (d,), "mtp.layers.0.eh_proj.weight": (d, 2 * d),
            f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight": (d,)}  # fmt: skip
    for block, kind in enumerate(pattern):
        source = f"backbone.layers.{config.hybrid_override_pattern.index(kind)}."
        head.update(
            {f"mtp.layers.{block}.{k[len(source) :]}": v.shape for k, v in tensors.items() if k.startswith(source)}
        )
    dtype = tensors["backbone.embeddings.weight"].dtype
    tensors.update({k: random_value(k, torch.Size(shape), generator, False).to(dtype) for k, shape in head.items()})
    save_file(tensors, path, metadata={"format": "pt"})


def add_mtp_head(model: torch.nn.Module, path: Path, seed: int) -> None:
    """Add random `mtp.*` weights as Qwen3-Next / Qwen3.5 checkpoints ship them (transformers builds no MTP head):
    fc [d, 2d], pre_fc_norm_embedding, pre_fc_norm_hidden, norm and `mtp.layers.0` — a copy of one of the model's
    own full-attention decoder layers (experts saved fused), re-randomised."""
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layer = copy.deepcopy(text.layers[text.config.layer_types.index("full_attention")])
    d = text.config.hidden_size
    head = torch.nn.ParameterDict(
        {"fc": torch.nn.Parameter(torch.empty(d, 2 * d))}
        | {name: torch.nn.Parameter(torch.empty(d)) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    )
    randomise(layer, seed + 1, zero_centred_norms=True)
    randomise(head, seed + 2, zero_centred_norms=True)
    tensors = load_file(path)
    tensors.update({f"mtp.layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()})
    tensors.update({f"mtp.{k}.weight": v.detach().contiguous() for k, v in head.items()})
    save_file(tensors, path, metadata={"format": "pt"})


def fuse_experts(path: Path) -> None:
    """Rewrite per-expert `experts.E.{gate,up,down}_proj.weight` as the hub's fused `experts.gate_up_proj
    [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`."""
    tensors = load_file(path)
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k})
    for prefix in prefixes:
        num_experts = len({k for k in tensors if k.startswith(f"{prefix}.experts.") and k.endswith("down_proj.weight")})
        pop = lambda e, p: tensors.pop(f"{prefix}.experts.{e}.{p}_proj.weight")  # noqa: E731
        gate_up = [torch.cat([pop(e, "gate"), pop(e, "up")]) for e in range(num_experts)]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([pop(e, "down") for e in range(num_experts)])
    save_file(tensors, path, metadata={"format": "pt"})


def make_tokenizer(byte_level: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few English words, with a chat template.

    `byte_level`: a byte-level BPE over the same words instead — transformers loads Qwen3.5 checkpoints' tokenizers
    as its own byte-level `Qwen3_5Tokenizer` whatever they declare, which mangles a word-level vocabulary.
    """
    if byte_level:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = sorted({c for word in WORDS for c in word} | {"Ġ"})  # "Ġ": byte-level space
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
            initial_alphabet=alphabet,
            show_progress=False,
        )
        backend.train_from_iterator([" ".join(WORDS)] * 10 + [" " + word for word in WORDS] * 10, trainer)
    else:
        vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, "<unk>": 3}
        vocab.update({word: 4 + i for i, word in enumerate(WORDS)})
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_checkpoint(family: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Save a tiny random `family` model, its tokenizer and a generation config into `directory`.

    `family` may end in "+bpe": the same model with the byte-level tokenizer of the Qwen3.5 fixtures (a draft must
    share its target's tokenizer; see `draft_for`).
    """
    torch.manual_seed(seed)
    name, _, flavour = family.partition("+")
    model = {**FAMILIES, **GDN_VARIANT_FAMILIES, **MOE_VARIANT_FAMILIES, **DRAFT_FAMILIES, **DENSE_FAMILIES}[name]()
    gdn_family = name in QWEN_GDN_FAMILIES or name in GDN_VARIANT_FAMILIES
    randomise(model, seed, zero_centred_norms=gdn_family)
    model.to(dtype).save_pretrained(directory)
    if name in FUSED_EXPERT_FAMILIES:
        fuse_experts(directory / "model.safetensors")
    if gdn_family:
        add_mtp_head(model, directory / "model.safetensors", seed)
    if name in NEMOTRON_MTP_FAMILIES:
        add_nemotron_mtp_head(model.config, directory / "model.safetensors", seed)
    make_tokenizer(byte_level=name in BYTE_LEVEL_FAMILIES or flavour == "bpe").save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


def engine_config(max_num_seqs: int, num_speculative_tokens: int = 0, decode_plan: bool = False, **options):
    """The `EngineConfig` of a bare `Scheduler` in tests: `max_num_seqs` slots, up to `num_speculative_tokens`
    drafts per step (with a proposer the test passes), the module path unless `decode_plan`."""
    from workers.config import EngineConfig
    from workers.spec_decode import SpeculativeConfig

    speculative = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens) if num_speculative_tokens else None
    return EngineConfig().replace(
        max_num_seqs=max_num_seqs, decode_plan=decode_plan, speculative=speculative, **options
    )
