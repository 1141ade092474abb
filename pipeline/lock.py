"""One run at a time per output directory: `_lock.json`, a marker naming the run that holds the directory.

Two runs on one `--output` would delete each other's temporaries and race to write the same shard files. A run
creates `_lock.json` (host, pid, the process's start time, a token) once the directory is known to be its job's, and
removes it when it ends (any way short of SIGKILL). On a local filesystem the creation is atomic: the marker is
written under a temporary name and hard-linked to `_lock.json`, which fails when the name exists. A second run then
refuses in one line naming the holder. A marker whose process is gone — same host, and the pid not running or
running since another time (a reused pid) — is stale and taken over; one from another host cannot be checked from
here and is refused naming that host. Object stores have no atomic create-if-absent: there the marker is written
and read back to see which run won (best effort).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

from pipeline.output import OutputDir, OutputRefused

LOCK = "_lock.json"
MAX_ATTEMPTS = 5  # stale markers taken over (or markers that vanished while read) before giving up


def process_start_time(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (`/proc/PID/stat`); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]  # field 22; the command name may hold spaces
    except (OSError, IndexError):
        return None


def holder_alive(holder: dict[str, Any]) -> bool | None:
    """Whether the run that wrote a marker still runs: True, False, or None (another host: this one cannot tell)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    recorded, now = holder.get("started"), process_start_time(pid)
    return recorded is None or now is None or recorded == now


class OutputLock:
    """Holds `_lock.json` in an output directory for the life of a `with` block; `OutputRefused` when a live run
    holds it."""

    def __init__(self, out: OutputDir):
        self.out = out
        pid = os.getpid()
        self.owner = {
            "host": socket.gethostname(),
            "pid": pid,
            "started": process_start_time(pid),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "token": uuid.uuid4().hex,
        }
        self.held = False

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the marker, taking over a stale one; `OutputRefused` naming the holder when a live run has it."""
        for _ in range(MAX_ATTEMPTS):
            if self._create():
                self.held = True
                return
            holder = self._read()
            if holder is None:
                continue  # removed since: try again
            alive = holder_alive(holder)
            if alive is False:
                self._take_over(holder)
                continue
            raise OutputRefused(self._refusal(holder, alive))
        raise OutputRefused(
            f"{self.out.join(LOCK)} kept changing while this run tried to take it: another run is "
            "starting on this directory; give each run its own --output"
        )

    def release(self) -> None:
        """Remove the marker if it is still this run's."""
        if self.held and (self._read_quietly() or {}).get("token") == self.owner["token"]:
            self.out.delete(LOCK)
        self.held = False

    def _refusal(self, holder: dict[str, Any], alive: bool | None) -> str:
        who = f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
        if alive is None:
            return (
                f"output {self.out.uri} is held by a run on another machine ({who}; {self.out.join(LOCK)}): "
                f"if that run has ended, delete that file and rerun"
            )
        return f"output {self.out.uri} is in use by another run ({who}): wait for it to end, or give another --output"

    def _create(self) -> bool:
        """Create the marker unless one exists; whether this run now holds it."""
        text = json.dumps(self.owner)
        if not self.out.local:
            if self.out.exists(LOCK):
                return False
            self.out.write_text(LOCK, text)
            return (self._read_quietly() or {}).get("token") == self.owner["token"]
        temporary = self.out.join(f".{LOCK}.{uuid.uuid4().hex}.tmp")
        with open(temporary, "w") as f:
            f.write(text)
        try:
            os.link(temporary, self.out.join(LOCK))
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temporary)

    def _read(self) -> dict[str, Any] | None:
        """The marker's content; None when it vanished; `OutputRefused` when it cannot be read."""
        if not self.out.exists(LOCK):
            return None
        try:
            return self.out.read_json(LOCK)
        except FileNotFoundError:
            return None
        except OutputRefused:
            raise OutputRefused(
                f"{self.out.join(LOCK)} is unreadable: another run may be writing it; if no run "
                "uses this directory, delete that file and rerun"
            ) from None

    def _read_quietly(self) -> dict[str, Any] | None:
        try:
            return self._read()
        except OutputRefused:
            return None

    def _take_over(self, stale: dict[str, Any]) -> None:
        """Remove a stale marker — only the one that was read (another run may have replaced it meanwhile)."""
        if not self.out.local:
            self.out.delete(LOCK)
            return
        moved = self.out.join(f".{LOCK}.{uuid.uuid4().hex}.tmp")
        try:
            os.rename(self.out.join(LOCK), moved)
        except FileNotFoundError:
            return  # another run took it over first
        with open(moved) as f:
            text = f.read()
        if json.loads(text or "{}").get("token") != stale.get("token"):
            try:  # a live run's fresh marker: put it back unless yet another run made one
                os.link(moved, self.out.join(LOCK))
            except FileExistsError:
                pass
        os.unlink(moved)
