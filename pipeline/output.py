"""The output directory: Parquet shard files written atomically, the manifest, the _SUCCESS marker.

Works on any filesystem `pyarrow.fs` understands (local paths, s3://, gs://, …). A shard file is written under a
temporary name and renamed when complete, so a file with the final name is always whole.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
SHARD_METADATA_KEY = b"hybridgen.shard"


class OutputDir:
    """A directory on a pyarrow filesystem."""

    def __init__(self, uri: str):
        if "://" in uri:
            self.fs, self.path = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.path = pafs.LocalFileSystem(), os.path.abspath(uri)
        self.uri = uri
        self.fs.create_dir(self.path, recursive=True)

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
        """Parse a JSON file."""
        with self.fs.open_input_stream(self._join(name)) as stream:
            return json.loads(stream.read().decode())

    def write_text(self, name: str, text: str) -> None:
        """Write a small text file atomically (temporary name, then rename)."""
        temporary = self._join(f".{name}.{uuid.uuid4().hex}.tmp")
        with self.fs.open_output_stream(temporary) as stream:
            stream.write(text.encode())
        self.fs.move(temporary, self._join(name))

    def remove_temporaries(self) -> None:
        """Delete leftovers of writes that a crash interrupted."""
        for name in self.names():
            if name.startswith(".") and name.endswith(".tmp"):
                self.delete(name)
