"""Quickstart: load a local hybrid checkpoint and generate.

    python examples/quickstart.py [MODEL_DIR_OR_REPO_ID]

Without an argument it first saves a tiny random Granite 4.0-H-style checkpoint (transformers' config class and
`save_pretrained`, a word-level tokenizer) to output/tiny-granite-4.0-h, so it runs offline; the text is random.
"""

from __future__ import annotations

import sys
from pathlib import Path

from workers import ModelRunner, SamplingParams


def build_tiny_checkpoint(directory: Path) -> Path:
    """Save a tiny random GraniteMoeHybrid model and a small tokenizer into `directory`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, PreTrainedTokenizerFast

    words = "the a cat dog sat on mat and ran to big red hello world .".split()
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3} | {w: 4 + i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    config = GraniteMoeHybridConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_chunk_size=16, num_local_experts=0, shared_intermediate_size=128, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    """Generate for two prompts and print the results."""
    model = sys.argv[1] if len(sys.argv) > 1 else str(build_tiny_checkpoint(Path("output/tiny-granite-4.0-h")))
    runner = ModelRunner.from_pretrained(model, device="auto", dtype="auto")
    prompts = ["the cat sat on the", "hello world"]
    token_ids = [runner.tokenizer.encode(p) for p in prompts]
    results = runner.generate(token_ids, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0))
    for prompt, result in zip(prompts, results):
        print(f"{prompt!r} -> {result.text!r} ({len(result.token_ids)} tokens, {result.finish_reason})")


if __name__ == "__main__":
    main()
