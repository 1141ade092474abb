"""A request's output token ids → its text, with vLLM's text options, and the stop-string search on that text.

`skip_special_tokens` is the tokenizer's own. `spaces_between_special_tokens` follows vLLM's fast detokenizer:
True (the default) is the tokenizer's decode as it is; False (with special tokens kept) writes an added token that
directly follows another added token as its bare content, without the space the decoder put before it. Stop
strings are searched in the same text the row gets, so a stop string spanning tokens is found where it completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.sampling import SamplingParams


def added_token_contents(tokenizer: Any) -> dict[int, str]:
    """Token id → text of the tokenizer's added tokens (special or not), cached on the tokenizer."""
    contents = getattr(tokenizer, "_hybridgen_added_tokens", None)
    if contents is None:
        contents = {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
        tokenizer._hybridgen_added_tokens = contents
    return contents


def decode_text(tokenizer: Any, token_ids: Sequence[int], params: SamplingParams) -> str:
    """The text of `token_ids` as `params` asks (see the module doc)."""
    ids = list(token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if params.skip_special_tokens or params.spaces_between_special_tokens:
        return text
    added = added_token_contents(tokenizer)
    cuts = []  # (start, length) of the separators to drop, in text order
    for i in range(1, len(ids)):
        content = added.get(ids[i])
        if content is None or ids[i - 1] not in added:
            continue
        before = tokenizer.decode(ids[:i], skip_special_tokens=False)
        after = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        delta = after[len(before) :]
        # Only where the decode of a prefix is a prefix of the whole (it is, at added-token boundaries).
        if text.startswith(after) and after.startswith(before) and delta.endswith(content) and delta != content:
            cuts.append((len(before), len(delta) - len(content)))
    for start, length in reversed(cuts):
        text = text[:start] + text[start + length :]
    return text


def find_stop(text: str, stops: Sequence[str], settled: int, include: bool) -> int | None:
    """Where the text ends when one of `stops` occurs in it ending after the first `settled` characters (the text
    seen before, where no stop string ended), else None: before the stop string, or after it when `include`
    (vLLM's `include_stop_str_in_output`)."""
    for stop in stops:
        start = text.find(stop, max(0, settled - len(stop) + 1))
        if start != -1:
            return start + len(stop) if include else start
    return None
