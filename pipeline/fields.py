"""The config dataclasses' field helpers: a field carrying its CLI help text, and the one-line error naming a flag."""

from __future__ import annotations

from dataclasses import field
from typing import Any, NoReturn


def doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field carrying its CLI help text."""
    return field(metadata={"help": text}, **kwargs)


def fail(cls: str, name: str, value: Any, allowed: str) -> NoReturn:
    """`ValueError` naming the flag, its config field (`cls.name`), the value and what is allowed."""
    flag = "--" + name.replace("_", "-")
    raise ValueError(f"{flag} ({cls}.{name}) = {value!r} is invalid: {allowed}")
