"""How the driver words what Ray reports: one line per error, whatever Ray's text holds (a remote traceback in
terminal colours, the dead actor's address)."""

from __future__ import annotations

import re

ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, without terminal colour codes."""
    text = ANSI_CODE.sub("", str(error)).strip()
    return f"{type(error).__name__}: {(text.splitlines() or [''])[0]}"


def node_ip(error: BaseException) -> str:
    """The node a dead actor ran on, from Ray's error text ("ip: 10.0.0.5"), or '?'."""
    lines = [line.strip() for line in str(error).splitlines()]
    return next((line[len("ip:") :].strip() for line in lines if line.startswith("ip:")), "?")
