"""The build cache of the native kernels: compile once per machine, load only what this user built, unchanged.

The cache is `$HYBRIDGEN_KERNEL_CACHE` (default `~/.cache/hybridgen/kernels`), created with mode 0700. A build
is keyed by the sources, the compiler command (with the `-march` of its instruction-set variant, see
`native.ISA_FLAGS`) and the CPU's feature flags; for key K (its first 16 hex digits below) the cache holds

    hybridgen-kernels-<machine>-<K>.sha256       the build record: K in full and the sha256 S of the library
    hybridgen-kernels-<machine>-<K>-<S>.so       that library (the first 16 hex digits of S in its name)

Rules, so that another local user cannot make every worker run their code:
- a cache directory not owned by this user, or writable by group or others, is refused: nothing is read from or
  written to it; the kernels are compiled into a private temporary directory for this process instead (same
  kernels, a compile per process), with a warning saying how to fix it;
- a record or library not owned by this user, writable by group or others, or not a regular file, and a library
  whose bytes do not hash to the recorded S, are never loaded: the kernels are compiled again, with a warning;
- the hash is computed from the same open file descriptor the library is then loaded through (`/proc/self/fd`
  where there is one), so the file cannot be swapped between the check and the load.

Concurrent builders (Ray actors sharing a node) compile into their own temporary names; each publishes its library
under its content's name with an atomic rename, then its record the same way, so a record only ever names a
complete library with that hash.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import re
import stat
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class NativeKernelError(RuntimeError):
    """The native kernels could not be built or loaded on this machine."""


class _Unusable(Exception):
    """A cached record or library that must not be loaded; the message says why."""


def cache_directory() -> Path:
    """Where builds are cached: `$HYBRIDGEN_KERNEL_CACHE`, else `~/.cache/hybridgen/kernels`."""
    default = Path.home() / ".cache" / "hybridgen" / "kernels"
    return Path(os.environ.get("HYBRIDGEN_KERNEL_CACHE", default))


def build_key(inputs: list[Path], compiler: str, flags: list[str]) -> str:
    """The sha256 (hex) naming a build: the compiler command, the CPU's features and every source and header."""
    digest = hashlib.sha256(" ".join([compiler, *flags, _cpu_flags()]).encode())
    for path in inputs:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def open_library(sources: list[Path], headers: list[Path], compiler: str, flags: list[str]) -> tuple[ctypes.CDLL, Path]:
    """(the library built from `sources`, the file it was loaded from): a verified cached build, else a new one.

    Raises NativeKernelError when the compiler fails, OSError when the library cannot be loaded.
    """
    key = build_key([*sources, *headers], compiler, flags)
    directory = cache_directory()
    refused = _prepare(directory)
    if refused is not None:
        logger.warning(
            "kernel cache %s refused: %s; compiling the native kernels into a private temporary directory for this "
            "process instead (make it yours with mode 0700, or set HYBRIDGEN_KERNEL_CACHE to a directory that is)",
            directory,
            refused,
        )
        with tempfile.TemporaryDirectory(prefix="hybridgen-kernels-") as private:
            return _compile_and_open(Path(private), key, sources, compiler, flags)
    cached = _open_cached(directory, key)
    if cached is not None:
        return cached
    return _compile_and_open(directory, key, sources, compiler, flags)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _stem(key: str) -> str:
    return f"hybridgen-kernels-{platform.machine()}-{key[:16]}"


def _unsafe_reason(status: os.stat_result) -> str | None:
    """Why a file or directory with this status is not to be trusted, or None."""
    if status.st_uid != os.geteuid():
        return f"owned by uid {status.st_uid}, not by this user (uid {os.geteuid()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(status.st_mode):04o})"
    return None


def _prepare(directory: Path) -> str | None:
    """Create the cache directory (mode 0700) if missing; returns why it is refused, or None."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = directory.stat()
    except OSError as error:
        return f"it cannot be created ({error})"
    return _unsafe_reason(status)


def _open_checked(path: Path) -> int:
    """A read-only descriptor of `path`, a regular file this user owns that group and others cannot write."""
    fd = os.open(path, _OPEN_FLAGS)
    status = os.fstat(fd)
    reason = "not a regular file" if not stat.S_ISREG(status.st_mode) else _unsafe_reason(status)
    if reason is not None:
        os.close(fd)
        raise _Unusable(f"{path} is {reason}")
    return fd


def _sha256(fd: int) -> str:
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _read_record(path: Path, key: str) -> str:
    """The library sha256 the build record at `path` holds for build `key`."""
    with os.fdopen(_open_checked(path)) as file:
        text = file.read(4096)
    try:
        record = json.loads(text)
        recorded_key, digest = record["build_key"], record["sha256"]
    except (ValueError, KeyError, TypeError):
        raise _Unusable(f"{path} is not a build record") from None
    if recorded_key != key or not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise _Unusable(f"{path} records another build")
    return digest


def _open_cached(directory: Path, key: str) -> tuple[ctypes.CDLL, Path] | None:
    """The cached build of `key` when there is one this user made and its bytes match its record, else None."""
    record = directory / f"{_stem(key)}.sha256"
    try:
        digest = _read_record(record, key)
        library = directory / f"{_stem(key)}-{digest[:16]}.so"
        fd = _open_checked(library)
    except FileNotFoundError:
        return None
    except (_Unusable, OSError) as error:
        logger.warning("%s; not loading it: compiling the native kernels again", error)
        return None
    if _sha256(fd) != digest:
        os.close(fd)
        logger.warning(
            "%s does not match the sha256 recorded when it was built; not loading it: compiling the native kernels "
            "again",
            library,
        )
        return None
    return _load(fd, library), library


def _compile(directory: Path, sources: list[Path], compiler: str, flags: list[str]) -> Path:
    """Compile `sources` into a new temporary file in `directory` (mode 0700 whatever the umask); returns it."""
    fd, name = tempfile.mkstemp(dir=directory, suffix=".so.partial")
    os.close(fd)
    partial = Path(name)
    command = [compiler, *flags, *map(str, sources), "-o", name, "-lm"]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeKernelError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        partial.chmod(0o700)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return partial


def _compile_and_open(
    directory: Path, key: str, sources: list[Path], compiler: str, flags: list[str]
) -> tuple[ctypes.CDLL, Path]:
    """Compile, publish (library, then its record) and load the build from the descriptor it was hashed through."""
    partial = _compile(directory, sources, compiler, flags)
    try:
        fd = os.open(partial, _OPEN_FLAGS)
        try:
            digest = _sha256(fd)
            library = directory / f"{_stem(key)}-{digest[:16]}.so"
            os.replace(partial, library)
            _write_record(directory / f"{_stem(key)}.sha256", key, digest)
        except BaseException:
            os.close(fd)
            raise
    finally:
        partial.unlink(missing_ok=True)
    return _load(fd, library), library


def _write_record(path: Path, key: str, digest: str) -> None:
    """Write the build record atomically (a temporary name, mode 0600, then a rename)."""
    fd, partial = tempfile.mkstemp(dir=path.parent, suffix=".sha256.partial")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump({"build_key": key, "sha256": digest}, file)
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


def _load(fd: int, library: Path) -> ctypes.CDLL:
    """Load the library open at `fd` (checked and hashed through it) by the descriptor where the system allows.

    The descriptor is then kept open for the life of the process: the loader knows a library by the name it was
    opened under, so a later load under a reused /proc/self/fd name would get this one back.
    """
    by_descriptor = Path(f"/proc/self/fd/{fd}")
    if not by_descriptor.exists():
        os.close(fd)
        return ctypes.CDLL(str(library))
    try:
        return ctypes.CDLL(str(by_descriptor))
    except OSError:
        os.close(fd)
        raise
