"""Train the embedded demo models: a Granite-4.0-H-style hybrid target, a smaller hybrid draft, and a
Qwen3.5-style Gated DeltaNet hybrid with an MTP head (`jobs/demo_gdn.py`).

    python jobs/train_demo.py                  # the pair: ~20 minutes on 2 CPU cores (measured: 20 min); writes examples/models/ and examples/prompts.jsonl
    python jobs/train_demo.py --only demo-gdn  # one model, with the shipped tokenizer; prompts are left as they are

demo-gdn (350 steps) took 42 min measured on 2 cores shared with other jobs; its steps took ~2.5 s on quiet cores
(~15 min in all). Plain `python jobs/train_demo.py` trains all three and retrains the tokenizer.

Corpus: the Python standard library's `.py` sources (every machine has them offline), with a fixed held-out set of
files for evaluation and prompts. One byte-level BPE tokenizer for every model. Training uses transformers'
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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jobs import demo_gdn

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
NAMES = ("demo-draft", "demo-target", "demo-gdn")
LossParts = tuple[torch.Tensor, dict[str, torch.Tensor]]


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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All files tokenized and joined with eos."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text) + [eos]
    return torch.tensor(ids)


def train_loop(
    name: str,
    parameters: list[torch.nn.Parameter],
    loss_fn: Callable[[torch.Tensor], LossParts],
    stream: torch.Tensor,
    steps: int,
    seq_len: int,
    batch: int,
    seed: int,
) -> None:
    """AdamW with warmup and a cosine schedule on random windows of `stream`; `loss_fn(x)` → (loss to minimise,
    the named parts to log)."""
    optimizer = torch.optim.AdamW(parameters, lr=2e-3, weight_decay=0.05, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    start = time.time()
    for step in range(steps):
        lr = 2e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=generator)
        x = torch.stack([stream[o : o + seq_len] for o in offsets.tolist()])
        loss, parts = loss_fn(x)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            logged = " ".join(f"{key} {value.item():.3f}" for key, value in parts.items())
            print(f"{name} step {step:4d} {logged} ({time.time() - start:.0f} s)", flush=True)


def train(name: str, stream: torch.Tensor, vocab_size: int, steps: int, seq_len: int, batch: int, seed: int):
    """Train one model of the pair; returns the transformers model."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        num_local_experts=0,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        position_embedding_type="rope",
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=1,
        bos_token_id=0,
        max_position_embeddings=2048,
        **MODELS[name],
    )
    model = GraniteMoeHybridForCausalLM(config)

    def loss_fn(x: torch.Tensor) -> LossParts:
        loss = model(x, labels=x).loss
        return loss, {"loss": loss}

    train_loop(name, list(model.parameters()), loss_fn, stream, steps, seq_len, batch, seed)
    return model.eval()


def train_gdn(stream: torch.Tensor, tokenizer, steps: int, seq_len: int, batch: int, seed: int):
    """Train the GDN demo model and its MTP head together: next-token loss + MTP_LOSS_WEIGHT × the MTP's
    token-t+2 loss. Returns (model, head)."""
    torch.manual_seed(seed)
    config = demo_gdn.gdn_config(
        len(tokenizer), tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(PAD)
    )
    model, head = demo_gdn.build(config)

    def loss_fn(x: torch.Tensor) -> LossParts:
        main, mtp = demo_gdn.losses(model, head, x)
        return main + demo_gdn.MTP_LOSS_WEIGHT * mtp, {"loss": main, "mtp_loss": mtp}

    parameters = list(model.parameters()) + list(head.parameters())
    train_loop("demo-gdn", parameters, loss_fn, stream, steps, seq_len, batch, seed)
    return model.eval(), head.eval()


def save_model(model, directory: Path, tokenizer, extra_tensors: dict[str, torch.Tensor] | None = None) -> None:
    """A bfloat16 HF directory: weights (plus `extra_tensors`, bfloat16, in the same file), tokenizer and
    generation config."""
    model.to(torch.bfloat16).save_pretrained(directory)
    if extra_tensors:
        weights = directory / "model.safetensors"
        tensors = load_file(weights) | {k: v.to(torch.bfloat16) for k, v in extra_tensors.items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    generation = {"eos_token_id": tokenizer.convert_tokens_to_ids(EOS), "pad_token_id": 1}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))


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
    """Tokenizer, models, prompts; saved under examples/."""
    from transformers import PreTrainedTokenizerFast

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-steps", type=int, default=500)
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--gdn-steps", type=int, default=350)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=NAMES,
        help="train only these models, reusing the shipped "
        "tokenizer (examples/models/demo-target) and leaving the prompts as they are",
    )
    parser.add_argument("--out", default=str(ROOT / "examples"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    out, names = Path(args.out), args.only or NAMES
    train_files, held_files = stdlib_files()
    train_texts, held_texts = read(train_files), read(held_files)
    if args.only:
        shipped = out / "models" / "demo-target" / "tokenizer.json"
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(shipped), eos_token=EOS, pad_token=PAD)
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab_size)
    stream = token_stream(train_texts, tokenizer)
    print(f"{len(train_texts)} training files ({len(stream)} tokens), {len(held_texts)} held out", flush=True)
    for name, steps, seed in (("demo-draft", args.draft_steps, 1), ("demo-target", args.target_steps, 0)):
        if name in names:
            save_model(
                train(name, stream, len(tokenizer), steps, seq_len=256, batch=16, seed=seed),
                out / "models" / name,
                tokenizer,
            )
    if "demo-gdn" in names:
        model, head = train_gdn(stream, tokenizer, args.gdn_steps, seq_len=256, batch=16, seed=2)
        save_model(model, out / "models" / "demo-gdn", tokenizer, demo_gdn.mtp_tensors(head))
    if args.only:
        return
    prompts = make_prompts(held_texts, 200, seed=0)
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "models" / "held_out_files.txt").write_text(
        "".join(str(p.relative_to(Path(sysconfig.get_paths()["stdlib"]))) + "\n" for p in held_files)
    )


if __name__ == "__main__":
    main()
