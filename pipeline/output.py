"""The output directory: Parquet shard files written atomically, the manifest, the _SUCCESS marker.

Works on any filesystem `pyarrow.fs` understands (local paths, s3://, gs://, …). A shard file is written under a
temporary name and renamed when complete, so a file with the final name is always whole. Nothing is created or
removed until the driver has checked that the directory is this job's (`pipeline/manifest.py`), and then only the
job's own files: its temporaries are named `.{file}.{32 hex digits}.tmp`.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
SHARD_METADATA_KEY = b"hybridgen.shard"
# The temporaries this code writes (`write_table`, `write_text`): a leading dot, the final name, a uuid4 hex.
OWN_TEMPORARY = re.compile(r"\.(part-\d+\.parquet|_manifest\.json|_SUCCESS|_lock\.json)\.[0-9a-f]{32}\.tmp")


class OutputRefused(ValueError):
    """`--output` cannot take this job (another job's files, a file where the directory should be, another run
    holding it): the CLI prints the message in one line and exits with status 2."""


class OutputDir:
    """A directory on a pyarrow filesystem (created by `create`, not before)."""

    def __init__(self, uri: str):
        try:
            if "://" in uri:
                self.fs, self.path = pafs.FileSystem.from_uri(uri)
            else:
                self.fs, self.path = pafs.LocalFileSystem(), os.path.abspath(uri)
        except (OSError, pa.ArrowException) as error:
            raise OutputRefused(f"--output {uri}: cannot be opened ({error})") from None
        self.uri = uri

    @property
    def local(self) -> bool:
        """Whether the directory is on this machine's filesystem (atomic create-if-absent works there)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def check_directory(self) -> None:
        """`OutputRefused` unless the path is a directory or nothing yet."""
        if self.fs.get_file_info(self.path).type == pafs.FileType.File:
            raise OutputRefused(
                f"--output {self.uri} is a file, not a directory: give a directory (new or one this job wrote)"
            )

    def create(self) -> None:
        """Make the directory (and its parents) if it does not exist."""
        self.fs.create_dir(self.path, recursive=True)

    def join(self, name: str) -> str:
        """The path of `name` in the directory, for this directory's filesystem."""
        return self._join(name)

    def _join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def exists(self, name: str) -> bool:
        """Whether `name` exists in the directory."""
        return self.fs.get_file_info(self._join(name)).type != pafs.FileType.NotFound

    def names(self) -> list[str]:
        """File names directly in the directory."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted(info.base_name for info in infos if info.type == pafs.FileType.File)

    def delete(self, name: str) -> None:
        """Remove one file (if present)."""
        if self.exists(name):
            self.fs.delete_file(self._join(name))

    def write_table(self, name: str, table: pa.Table, shard_info: dict[str, Any]) -> None:
        """Write a Parquet file under a temporary name, then rename it to `name`."""
        metadata = dict(table.schema.metadata or {})
        metadata[SHARD_METADATA_KEY] = json.dumps(shard_info).encode()
        table = table.replace_schema_metadata(metadata)
        temporary = self._join(f".{name}.{uuid.uuid4().hex}.tmp")
        with self.fs.open_output_stream(temporary) as stream:
            pq.write_table(table, stream)
        self.fs.move(temporary, self._join(name))

    def read_table(self, name: str) -> pa.Table:
        """Read one Parquet file."""
        with self.fs.open_input_file(self._join(name)) as stream:
            return pq.read_table(stream)

    def shard_info(self, name: str) -> dict[str, Any]:
        """The per-shard stats stored in a shard file's footer (rows, seconds, tokens …)."""
        with self.fs.open_input_file(self._join(name)) as stream:
            metadata = pq.read_schema(stream).metadata or {}
        return json.loads(metadata.get(SHARD_METADATA_KEY, b"{}"))

    def read_json(self, name: str) -> dict[str, Any]:
        """Parse a JSON file holding an object; `OutputRefused` naming it when it is not one."""
        with self.fs.open_input_stream(self._join(name)) as stream:
            data = stream.read()
        try:
            value = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise OutputRefused(
                f"{self._join(name)} is not valid JSON ({error}): not a file this job wrote whole; "
                "move it away, or use --overwrite to replace the directory's job"
            ) from None
        if not isinstance(value, dict):
            raise OutputRefused(f"{self._join(name)} does not hold a JSON object: move it away, or use --overwrite")
        return value

    def write_text(self, name: str, text: str) -> None:
        """Write a small text file atomically (temporary name, then rename)."""
        temporary = self._join(f".{name}.{uuid.uuid4().hex}.tmp")
        with self.fs.open_output_stream(temporary) as stream:
            stream.write(text.encode())
        self.fs.move(temporary, self._join(name))

    def remove_temporaries(self) -> None:
        """Delete this code's leftover temporaries (writes a crash interrupted); other files stay."""
        for name in self.names():
            if OWN_TEMPORARY.fullmatch(name):
                self.delete(name)
