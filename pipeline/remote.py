"""Inputs on object storage (`s3://`, `gs://`, … whatever `pyarrow.fs` understands), copied to a local directory.

The driver reads the input once to plan shards. Copying the matching files first lets a remote input be read exactly
like a local one (same builders, same column types); a glob matches as a local one does (`*` stays within a folder).
The copy, and the Arrow cache `datasets` makes of it (which would otherwise add a copy per run to its own cache,
keyed by the copy's new path), live in temporary directories removed when the driver exits. Credentials and
endpoints come from the usual environment (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, … for S3).
"""

from __future__ import annotations

import atexit
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

GLOB_CHARS = "*?["


def is_remote(source: str) -> bool:
    """Whether `source` is a URI with a scheme (s3://…) rather than a local path or a hub dataset name."""
    return "://" in source


def local_copy(uri: str) -> str:
    """A local path holding the file, directory or glob matches at `uri`; `FileNotFoundError` or `ValueError`."""
    scheme, _, rest = uri.partition("://")
    cut = min((rest.find(c) for c in GLOB_CHARS if c in rest), default=-1)
    if cut < 0:
        base_rest, pattern = rest.rstrip("/"), None
    else:  # the directory above the first glob character, and the pattern below it
        base_rest = rest[:cut].rsplit("/", 1)[0]
        pattern = rest[len(base_rest) + 1 :]
    try:
        fs, base = pafs.FileSystem.from_uri(f"{scheme}://{base_rest}")
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"input {uri!r} does not exist")
        target = Path(scratch_directory("hybridgen-input-"))
        if info.type == pafs.FileType.File:
            return str(_download(fs, base, inside(target, Path(base).name, f"{scheme}://{base}")))
        listing = fs.get_file_info(pafs.FileSelector(base, recursive=True))
        relatives = [(f.path, f.path[len(base.rstrip("/")) + 1 :]) for f in listing if f.type == pafs.FileType.File]
        # Every listed key is checked, matched or not: one that would land outside the copy is refused, named.
        copies = [(relative, path, inside(target, relative, f"{scheme}://{path}")) for path, relative in relatives]
        chosen = [(path, local) for relative, path, local in copies if pattern is None or glob_match(relative, pattern)]
        if not chosen:
            raise ValueError(f"no files match input {uri!r}")
        for path, local in chosen:
            _download(fs, path, local)
        return str(target)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"input {uri!r} cannot be read: {error}") from None


def scratch_directory(prefix: str) -> str:
    """A new temporary directory, removed with everything in it when this process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def glob_match(relative: str, pattern: str) -> bool:
    """Whether the path `relative` (folders joined by `/`) matches `pattern` as local `glob.glob(pattern,
    recursive=True)` would: `*`, `?` and `[…]` match within one folder or file name, `**` spans any number of
    folders, and a wildcard does not match a name that starts with a dot."""
    return _match(relative.split("/"), pattern.split("/"))


def _match(names: list[str], parts: list[str]) -> bool:
    if not parts:
        return not names
    if parts[0] == "**":  # zero or more folders, none of them hidden
        return any(
            _match(names[i:], parts[1:])
            for i in range(len(names) + 1)
            if not any(name.startswith(".") for name in names[:i])
        )
    if not names or (names[0].startswith(".") and not parts[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(names[0], parts[0]) and _match(names[1:], parts[1:])


def inside(directory: Path, relative: str, source: str) -> Path:
    """`directory / relative`, refused (`ValueError` naming the object `source`) unless it stays inside `directory`.

    Object keys are plain strings: `a/../../x` and `a//etc/x` (an absolute path once the prefix is cut) are valid
    S3 keys, and a naive join would write outside the copy's directory.
    """
    local = Path(os.path.normpath(directory / relative))
    if local == directory or directory not in local.parents:
        raise ValueError(
            f"input object {source!r} leads outside the local copy's directory ({relative!r} under "
            f"{directory}); refusing to copy it: rename the object"
        )
    return local


def _download(fs: pafs.FileSystem, path: str, local: Path) -> Path:
    local.parent.mkdir(parents=True, exist_ok=True)
    with fs.open_input_stream(path) as source, local.open("wb") as sink:
        shutil.copyfileobj(source, sink, length=16 << 20)
    return local
