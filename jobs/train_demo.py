"""Train the embedded demo pair: a small Granite-4.0-H-style hybrid target and a smaller hybrid draft.

    python jobs/train_demo.py                  # ~20 minutes on 2 CPU cores (measured: 20 min); writes examples/models/ and examples/prompts.jsonl

Corpus: the Python standard library's `.py` sources (every machine has them offline), with a fixed held-out set of
files for evaluation and prompts. One byte-level BPE tokenizer for both models. Training uses transformers'
modeling code; the saved checkpoints are standard HF directories (bfloat16 safetensors) that hybridgen loads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
PAD = "<|pad|>"
MODELS = {
    "demo-target": dict(hidden_size=256, num_hidden_layers=6, layer_types=["mamba", "mamba", "attention"] * 2,
                        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64,
                        mamba_d_state=32, shared_intermediate_size=768),
    "demo-draft": dict(hidden_size=128, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                       num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=64,
                       mamba_d_state=16, shared_intermediate_size=384),
}  # fmt: skip


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every ~20th file by a stable hash of its relative path is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size < 200_000)
    held_out = [p for p in files if int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0]
    held = set(held_out)
    return [p for p in files if p not in held], held_out


def read(paths: list[Path]) -> list[str]:
    """File texts (undecodable files skipped)."""
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer wrapped for transformers (eos at the end of each file, no bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All files tokenized and joined with eos."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text) + [eos]
    return torch.tensor(ids)


def train(name: str, stream: torch.Tensor, vocab_size: int, steps: int, seq_len: int, batch: int, seed: int):
    """Train one model with AdamW and a cosine schedule; returns the transformers model."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(vocab_size=vocab_size, num_local_experts=0, mamba_n_groups=1, mamba_d_conv=4,
                                    mamba_expand=2, mamba_chunk_size=64, position_embedding_type="rope",
                                    tie_word_embeddings=True, eos_token_id=0, pad_token_id=1, bos_token_id=0,
                                    max_position_embeddings=2048, **MODELS[name])  # fmt: skip
    model = GraniteMoeHybridForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    start = time.time()
    for step in range(steps):
        lr = 2e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=generator)
        x = torch.stack([stream[o : o + seq_len] for o in offsets.tolist()])
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"{name} step {step:4d} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    return model.eval()


def make_prompts(texts: list[str], count: int, seed: int) -> list[dict[str, str]]:
    """Code-completion prompts cut from held-out files; every third one is copy-heavy (a function, then its start again)."""
    rng = random.Random(seed)
    functions = []
    for text in texts:
        lines = text.splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        for i in starts:
            body = lines[i : i + 12]
            if len(body) >= 6 and all(len(line) < 100 for line in body):
                functions.append(body)
    rng.shuffle(functions)
    prompts = []
    for k, body in enumerate(functions[:count]):
        if k % 3 == 2:
            prompt = "\n".join(body) + "\n\n\n" + "\n".join(body[:2]) + "\n"
            kind = "copy"
        else:
            prompt = "\n".join(body[: rng.randint(3, 6)]) + "\n"
            kind = "continue"
        prompts.append({"id": f"demo-{k:03d}", "kind": kind, "prompt": prompt})
    return prompts


def main() -> None:
    """Tokenizer, both models, prompts; saved under examples/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-steps", type=int, default=500)
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", default=str(ROOT / "examples"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    train_files, held_files = stdlib_files()
    train_texts, held_texts = read(train_files), read(held_files)
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    stream = token_stream(train_texts, tokenizer)
    print(f"{len(train_texts)} training files ({len(stream)} tokens), {len(held_texts)} held out", flush=True)
    out = Path(args.out)
    for name, steps, seed in (("demo-draft", args.draft_steps, 1), ("demo-target", args.target_steps, 0)):
        model = train(name, stream, len(tokenizer), steps, seq_len=256, batch=16, seed=seed)
        directory = out / "models" / name
        model.to(torch.bfloat16).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        generation = {"eos_token_id": tokenizer.convert_tokens_to_ids(EOS), "pad_token_id": 1}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    prompts = make_prompts(held_texts, 200, seed=0)
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "models" / "held_out_files.txt").write_text(
        "".join(str(p.relative_to(Path(sysconfig.get_paths()["stdlib"]))) + "\n" for p in held_files)
    )


if __name__ == "__main__":
    main()
