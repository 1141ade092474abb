"""Which Ray cluster `--ray-address` means, checked without Ray: is anything listening there, what was recorded.

Ray's own `ray.init(address="auto")` retries "Failed to connect to GCS" for minutes when the address recorded by an
earlier `ray start` belongs to a head that died uncleanly; the driver asks these first.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlparse


def answers(address: str, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at the address's host:port within `timeout_s` (retrying)."""
    parsed = urlparse(address if "://" in address else f"//{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a port that is not a number
        return True  # not host:port: let ray.init judge it
    if not host or not port:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def recorded_address(path: str) -> str | None:
    """The address a `ray start` recorded in `path` (Ray's `ray_current_cluster` file), or None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None
