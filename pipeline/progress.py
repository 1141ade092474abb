"""The driver's progress bar: rows written, and the counters the shards bring back (tokens per second, prefix-cache
hits, speculative acceptance) as its postfix."""

from __future__ import annotations

import sys
from collections import Counter

from tqdm import tqdm


def say(message: str) -> None:
    """A line on the console (stderr) that does not break the progress bar."""
    tqdm.write(message, file=sys.stderr)


class ProgressCounts:
    """Sums the shards' counters and shows them on a tqdm bar."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def show(self, progress: tqdm, rows: int, stats: dict[str, float]) -> None:
        """Advance `progress` by a shard's `rows` and refresh its postfix with the shard's `stats` added."""
        self.counts.update({k: v for k, v in stats.items() if isinstance(v, (int, float))})
        elapsed = max(progress.format_dict["elapsed"], 1e-9)
        tokens = self.counts["generated_tokens"] or self.counts["scored_tokens"]
        postfix = {"tok/s": f"{tokens / elapsed:.0f}"}
        if self.counts["prefix_cache_hit_tokens"]:  # share of prompt tokens restored instead of computed
            postfix["prefix hit"] = f"{self.counts['prefix_cache_hit_tokens'] / self.counts['prompt_tokens']:.0%}"
        if self.counts["num_draft_tokens"]:
            postfix["accept"] = f"{self.counts['num_accepted_draft_tokens'] / self.counts['num_draft_tokens']:.2f}"
        progress.set_postfix(postfix, refresh=False)
        progress.update(rows)
