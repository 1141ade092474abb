"""Benchmark building blocks: model presets with random weights, timed hybridgen and transformers runs.

Both engines load the same checkpoint (saved once with transformers' `save_pretrained`) and get the same prompts.
Times are medians over repeats; prefill and decode are separated by timing a 1-token run.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.family_presets import FAMILY_PRESETS, build_family_preset, save_random_model

# Shapes of the runs compared. "bench" is NOTES.md's anchor config; "granite-4.0-h-1b" follows the published
# Granite 4.0-H-1B config (hidden 1536, 40 layers, 4 of them attention); "tiny" is for smoke tests.
# GraniteMoeHybrid checkpoints; GDN_PRESETS below are Qwen3.5 ones.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 attention_layers=[2], shared_intermediate_size=128, mamba_n_heads=4, mamba_d_head=32,
                 mamba_d_state=16, dtype="float32"),
    "bench": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  attention_layers=[3, 7], shared_intermediate_size=1536, mamba_n_heads=16, mamba_d_head=64,
                  mamba_d_state=128, dtype="float32"),
    "granite-4.0-h-1b": dict(vocab_size=100352, hidden_size=1536, num_hidden_layers=40, num_attention_heads=12,
                             num_key_value_heads=4, attention_layers=[5, 15, 25, 35], shared_intermediate_size=4096,
                             mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, dtype="bfloat16"),
}  # fmt: skip
# Gated DeltaNet hybrids (text-only Qwen3.5, `qwen3_5_text`). "gdn-bench" is Qwen3.5-0.8B's layout at the "bench"
# size: hidden 512, 8 layers with full attention at 3 and 7 (every 4th, as Qwen3.5), gated attention with 256-dim
# heads and partial RoPE 0.25, MLP 1536, vocab 32000, tied; linear attention with 4 key heads and 8 value heads of
# 128 (value heads = 2 × key heads as in Qwen3-Next; its state, 8 × 128 × 128 per layer, holds as many numbers as
# the "bench" Mamba2 layer's 16 × 64 × 128).
GDN_PRESETS: dict[str, dict[str, Any]] = {
    "gdn-tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, attention_layers=[3], intermediate_size=128, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, dtype="float32"),
    "gdn-bench": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=256, attention_layers=[3, 7], intermediate_size=1536,
                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                      linear_value_head_dim=128, dtype="float32"),
}  # fmt: skip
PRESETS.update(GDN_PRESETS)
# Liquid LFM2 (`lfm2`): "lfm2-bench" is LFM2's layout at the "bench" size: hidden 512, 8 layers with attention at 3
# and 7 (short convs elsewhere, 3 taps), 8 heads / 4 KV heads, MLP 1536 (taken as is: no auto-adjust), vocab
# 32000, tied; its recurrent state is only the conv window (512 × 2 numbers per layer).
LFM_PRESETS: dict[str, dict[str, Any]] = {
    "lfm2-bench": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, attention_layers=[3, 7], intermediate_size=1536, conv_L_cache=3,
                       dtype="float32"),
}  # fmt: skip
PRESETS.update(LFM_PRESETS)
# Falcon-H1 (`falcon_h1`): every layer runs Mamba2 and attention in parallel, then an MLP. "falcon-h1-bench" is the
# "bench" size: hidden 512, 8 layers, MLP 1536, vocab 32000, tied; Mamba2 16 heads × 64 with state 128 (the "bench"
# mixer), attention 8 heads / 2 KV heads of 64 in every layer; Falcon-H1-0.5B's μP multipliers and gated RMSNorm
# in the mixer (as Falcon-H1-1.5B … 34B).
FALCON_H1_PRESETS: dict[str, dict[str, Any]] = {
    "falcon-h1-bench": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, intermediate_size=1536, mamba_d_ssm=1024,
                            mamba_n_heads=16, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                            mamba_chunk_size=128, mamba_rms_norm=True, mamba_norm_before_gate=False,
                            embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625,
                            attention_out_multiplier=0.9375, key_multiplier=0.390625, ssm_in_multiplier=1.25,
                            ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
                            ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                            dtype="float32"),
}  # fmt: skip
PRESETS.update(FALCON_H1_PRESETS)
# Mixtures of experts. "moe-bench" is the "bench" shape (GraniteMoeHybrid) with its feed-forward as 32 experts of
# 256, top 4, plus a shared MLP of 512: active width 4 · 256 + 512 = 1536, the dense "bench" MLP's, so the two
# compare a MoE step with a dense step of the same active width. "qwen3-next-bench" is Qwen3-Next's layout at the
# "gdn-bench" size: 128 experts of 128, top 8 (softmax over the top 8), and a gated shared expert of 512.
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "moe-bench": {
        **PRESETS["bench"],
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "intermediate_size": 256,
        "shared_intermediate_size": 512,
    },
    "qwen3-next-bench": {
        **{k: v for k, v in GDN_PRESETS["gdn-bench"].items() if k != "intermediate_size"},
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
    },
}
PRESETS.update(MOE_PRESETS)
PRESETS.update({name: shape for name, (_, _, shape) in FAMILY_PRESETS.items()})


def build_preset(name: str, directory: Path) -> Path:
    """Save a random-weight checkpoint with the preset's shapes (reused when already there): GraniteMoeHybrid,
    text-only Qwen3.5 for the GDN presets, LFM2 for the LFM presets, or the family of a `FAMILY_PRESETS` one."""
    if (directory / "config.json").exists():
        return directory
    if name in FAMILY_PRESETS:
        return build_family_preset(name, directory)
    if name in GDN_PRESETS or name == "qwen3-next-bench":
        return _build_gdn_preset(name, directory)
    if name in LFM_PRESETS:
        return _build_lfm_preset(name, directory)
    if name in FALCON_H1_PRESETS:
        return _build_falcon_h1_preset(name, directory)
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    shape = dict(PRESETS[name])
    attention, dtype = shape.pop("attention_layers"), shape.pop("dtype")
    layer_types = ["attention" if i in attention else "mamba" for i in range(shape["num_hidden_layers"])]
    config = GraniteMoeHybridConfig(
        **{"num_local_experts": 0, **shape},
        layer_types=layer_types,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        tie_word_embeddings=True,
    )
    return save_random_model(GraniteMoeHybridForCausalLM, config, directory, dtype)


def _build_gdn_preset(name: str, directory: Path) -> Path:
    """Text-only Qwen3.5 for the GDN presets, Qwen3-Next for "qwen3-next-bench": full attention at
    `attention_layers`, Gated DeltaNet elsewhere."""
    import transformers

    qwen3_next = name == "qwen3-next-bench"
    config_class, model_class = (
        (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM)
        if qwen3_next
        else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM)
    )
    shape = dict(PRESETS[name])
    attention, dtype = shape.pop("attention_layers"), shape.pop("dtype")
    layer_types = [
        "full_attention" if i in attention else "linear_attention" for i in range(shape["num_hidden_layers"])
    ]
    config = config_class(**shape, layer_types=layer_types, tie_word_embeddings=True)
    return save_random_model(model_class, config, directory, dtype)


def _build_lfm_preset(name: str, directory: Path) -> Path:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    shape = dict(LFM_PRESETS[name])
    attention, dtype = shape.pop("attention_layers"), shape.pop("dtype")
    config = Lfm2Config(**shape, full_attn_idxs=attention, block_auto_adjust_ff_dim=False, tie_word_embeddings=True)
    return save_random_model(Lfm2ForCausalLM, config, directory, dtype)


def _build_falcon_h1_preset(name: str, directory: Path) -> Path:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    shape = dict(FALCON_H1_PRESETS[name])
    dtype = shape.pop("dtype")
    return save_random_model(FalconH1ForCausalLM, FalconH1Config(**shape, tie_word_embeddings=True), directory, dtype)


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def copy_heavy_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short phrase: a model that continues the pattern lets drafts be accepted."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(batch):
        phrase = torch.randint(10, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append((phrase * (length // len(phrase) + 1))[:length])
    return prompts


@dataclass
class Timing:
    """Median seconds of a run and what it produced."""

    seconds: float
    runs: list[float]


def timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> Timing:
    """Run `fn` once to warm up, then `repeats` times; median wall time."""
    fn()
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return Timing(statistics.median(runs), runs)


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated since the last `reset_peak_memory`, or the process's peak resident memory on CPU
    (ru_maxrss: over the whole process, it never goes down)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement (CUDA; the CPU figure cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def decode_step_bytes(model: Any, context_len: int) -> dict[str, int]:
    """What one batch-1 decode step must read from memory at least: every weight matrix it multiplies with once
    (the LM head included), one embedding row, one request's recurrent states, and its KV cache over `context_len`
    positions."""
    from workers.memory import kv_bytes_per_token, state_bytes_per_slot

    config, embed = model.config, model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    for module in model.modules():  # packed CPU linears hold their weights outside the parameters
        if not isinstance(module, torch.nn.Linear) and hasattr(module, "out_features"):
            weights += module.in_features * module.out_features * embed.element_size()
    row = embed.shape[1] * embed.element_size()
    if getattr(model.lm_head, "weight", None) is embed:  # tied: the table is read as the LM head, plus one row
        weights += row
    else:  # the table itself is only looked up
        weights -= embed.numel() * embed.element_size() - row
    return {
        "weights": weights,
        "states": state_bytes_per_slot(config, embed.dtype),
        "kv_cache": kv_bytes_per_token(config, embed.dtype) * context_len,
    }


H200_BANDWIDTH_GBS = 4800.0  # HBM3e peak of an H200 (NVIDIA's datasheet): the default for `roofline_share` on CUDA


def roofline_share(bytes_per_step: int, tokens_per_s: float, peak_gb_per_s: float) -> float:
    """Achieved ÷ peak bandwidth at batch 1: bytes one step reads × steps per second ÷ peak bytes per second."""
    return bytes_per_step * tokens_per_s / (peak_gb_per_s * 1e9)


def batch1_roofline(model: Any, rows: list[dict[str, Any]], bandwidth: float, context_len: int) -> dict[str, Any]:
    """The batch-1 share of the memory roofline, per engine: (bytes a decode step must read — weights, one
    request's states, its KV cache at `context_len` tokens) × (decode steps per second) ÷ peak bandwidth. Printed."""
    batch1 = next((r for r in rows if r["batch"] == 1), None)
    if batch1 is None:
        return {}
    needed = decode_step_bytes(model, context_len)
    total = sum(needed.values())
    shares = {
        r["engine"]: roofline_share(total, r["decode_tokens_per_s"], bandwidth)
        for r in [batch1, batch1.get("eager", {})]
        if r
    }
    print(
        f"\nbatch-1 roofline: a decode step reads {total / 1e6:.1f} MB (weights {needed['weights'] / 1e6:.1f}, "
        f"states {needed['states'] / 1e6:.1f}, KV {needed['kv_cache'] / 1e6:.2f}); at {bandwidth:.0f} GB/s "
        + ", ".join(f"{engine} reaches {share:.1%}" for engine, share in shares.items())
    )
    return {"bytes_per_step": needed, "peak_gb_per_s": bandwidth, "share": shares}


def hf_generate_fn(model: Any, prompts: list[list[int]], new_tokens: int) -> Callable[[], Any]:
    """transformers' greedy `generate` on equal-length prompts (no padding)."""
    ids = torch.tensor(prompts, device=model.device)

    def run() -> Any:
        with torch.inference_mode():
            return model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    return run


def hf_score_fn(model: Any, rows: list[list[int]]) -> Callable[[], Any]:
    """transformers' forward pass and token log-probs on equal-length rows."""
    ids = torch.tensor(rows, device=model.device)

    def run() -> Any:
        with torch.inference_mode():
            logits = model(ids).logits.float()
            return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])

    return run


def _cell(value: Any) -> str:
    """A table cell: floats with one decimal, or three significant digits below 10 (ratios, steps per token)."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Rows as an aligned text table (nested eager and transformers numbers flattened with eager_ and tf_ prefixes)."""
    flat = []
    for row in rows:
        item = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for nested, prefix in (("eager", "eager_"), ("transformers", "tf_")):
            item.update({prefix + k: v for k, v in row.get(nested, {}).items() if k not in ("engine", "batch")})
        flat.append(item)
    keys = list(dict.fromkeys(k for item in flat for k in item))
    cells = [[_cell(item.get(k, "")) for k in keys] for item in flat]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print(f"\n{title}")
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
