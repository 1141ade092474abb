"""Fixtures of the structured-outputs tests: a byte-level tokenizer that spells any ASCII text in a 128-token
vocabulary, tiny random checkpoints that use it, seeded random JSON schemas and regexes, and an independent oracle
(a transformers `LogitsProcessor` that applies a grammar through its own xgrammar matchers)."""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LogitsProcessor, PreTrainedTokenizerFast

from tests.tiny_models import VOCAB_SIZE, build_checkpoint

# Printable ASCII in the byte-level alphabet (space is "Ġ", newline "Ċ"): every ASCII text is spellable.
ASCII_ALPHABET = sorted(set(string.ascii_letters + string.digits + string.punctuation) | {"Ġ", "Ċ"})
CORPUS = ['{"name": "cat", "age": 12, "tags": ["a", "b"]}', "true false null", "hello world 123-456"]


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of 128 tokens: 4 specials (<pad> 0, <bos> 1, <eos> 2, <unk> 3), every printable ASCII
    character, and merges of a little JSON (so tokens span several characters, as real ones do)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
        initial_alphabet=ASCII_ALPHABET,
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def ascii_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """`tiny_models.build_checkpoint` with the ASCII tokenizer instead of the word-level one."""
    build_checkpoint(family, directory, seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    ascii_tokenizer().save_pretrained(directory)
    return directory


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema: nested objects with optional fields, arrays, enums, bounded integers, numbers,
    strings, booleans and nulls (small bounds, so a random model can finish within a few dozen tokens)."""
    kinds = ["integer", "string", "enum", "boolean", "null", "number"] + ["object", "array"] * (depth < 2)
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["a", "b", "id", "name", "x", "tags", "ok"], rng.randint(1, 3))
        properties = {name: random_schema(rng, depth + 1) for name in names}
        required = [name for name in names if rng.random() < 0.6]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    return {"type": kind}


def random_regex(rng: random.Random) -> str:
    """A random regex of classes, bounded and unbounded repeats, alternations and literals."""
    pieces = [
        lambda: f"[a-{rng.choice('cfz')}]{{1,{rng.randint(1, 4)}}}",
        lambda: f"[0-9]{{{rng.randint(1, 3)}}}",
        lambda: "(" + "|".join(rng.sample(["cat", "dog", "a", "null", "42"], rng.randint(2, 3))) + ")",
        lambda: rng.choice(["-", "\\.", ":", "_", "x?", "[ab]+", "(ab)?"]),
    ]
    return "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 4)))


class GrammarLogitsProcessor(LogitsProcessor):
    """transformers' side of the oracle: each row's own xgrammar matcher follows the tokens `generate` chose, and
    its mask is applied to the next scores (written from xgrammar's API, independently of `workers/`)."""

    def __init__(self, compiled, batch_size: int, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        self.xgrammar = xgrammar
        self.matchers = [
            xgrammar.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids) for _ in range(batch_size)
        ]
        self.bitmask = xgrammar.allocate_token_bitmask(batch_size, vocab_size)
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        elif input_ids.shape[1] > self.prompt_len:
            for row, matcher in enumerate(self.matchers):
                if not matcher.is_terminated():
                    assert matcher.accept_token(int(input_ids[row, -1]))
        for row, matcher in enumerate(self.matchers):
            matcher.fill_next_token_bitmask(self.bitmask, row)
        scores = scores.clone()
        self.xgrammar.apply_token_bitmask_inplace(scores, self.bitmask, vocab_size=scores.shape[-1])
        return scores
