"""The step's token budget: how many new tokens one forward may take, and how a step shares them.

`max_num_batched_tokens` (vLLM's name) bounds every forward of the target — a prefill chunk, a decode step, a
verification step — counting padded tokens (rows × the widest row), since padding costs memory and time as real
tokens do. Long prompts are prefilled in chunks continued through the recurrent states and KV cache, and a step
runs one prefill forward *and* one decode (or verification) forward of the requests already generating, so a
long prompt never stalls the others: interleaving rather than mixing both in one forward, because the model's
padded batch layout would pad every one-token decode row to the chunk's width.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenBudget:
    """Decides the token counts of a step's forwards from what is waiting (pure: ints in, ints out)."""

    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens!r} is invalid: must be an integer ≥ 1"
            )

    def prefill_chunks(self, remaining: list[int]) -> list[int]:
        """New prompt tokens for the first requests of the prefill queue this step (the rest wait).

        `remaining[i]`: prompt tokens request i still has to prefill (rows continuing from their states, a chunked
        prompt's rest or a prefix-cache hit, share forwards as new ones do). A request whose rest exceeds the budget
        runs alone (its forward is one long row); others share a forward while rows × the widest rest fits.
        """
        chunks: list[int] = []
        for left in remaining:
            if left > self.max_num_batched_tokens:
                return chunks if chunks else [self.max_num_batched_tokens]
            if (len(chunks) + 1) * max(chunks + [left]) > self.max_num_batched_tokens:
                break
            chunks.append(left)
        return chunks

    def max_drafts(self, num_rows: int, num_speculative_tokens: int) -> int:
        """Drafts per row a verification of `num_rows` rows may carry: rows × (1 + k) within the budget."""
        return max(0, min(num_speculative_tokens, self.max_num_batched_tokens // max(1, num_rows) - 1))
