"""Input cells as Python values, one row at a time: a value that cannot be decoded is that row's error, never the
shard's.

`datasets` stores what it reads in several shapes, and a worker must accept each:
- text that is not valid UTF-8 (pyarrow's JSON reader lets it through; converting a whole column then raises for
  every row): decoded per row, the bad row gets an error naming the column and the byte;
- `arrow.json` extension values (a column whose values have mixed types, or a list of dicts whose keys differ
  between rows: chat messages with `name`, `tool_calls`, `tool_call_id`): JSON text, parsed;
- structs (a list of chat messages read from Parquet): every message gets every key of the struct, null where the
  message had none; null fields are left out — as in the JSON they came from — except `content`, which chat
  templates read from every message (null content: an assistant turn that only calls tools).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

JSON_EXTENSION = "arrow.json"
KEPT_NULL_FIELDS = frozenset({"content"})


def _is_json(type_: pa.DataType) -> bool:
    return getattr(type_, "extension_name", None) == JSON_EXTENSION


def decode_value(value: Any, type_: pa.DataType) -> Any:
    """`value` (an Arrow scalar's `as_py()`) with JSON text parsed and null struct fields dropped, at any depth."""
    if value is None:
        return None
    if _is_json(type_):
        return json.loads(value) if isinstance(value, str) else value
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        return [decode_value(item, type_.value_type) for item in value]
    if pa.types.is_struct(type_):
        fields = {f.name: f.type for f in type_}
        return {
            key: decode_value(item, fields[key])
            for key, item in value.items()
            if item is not None or key in KEPT_NULL_FIELDS
        }
    return value


def decode_cell(column: pa.ChunkedArray, row: int, name: str) -> Any:
    """One cell as a Python value; `ValueError` naming the column when it cannot be decoded."""
    try:
        return decode_value(column[row].as_py(), column.type)
    except UnicodeDecodeError as error:
        byte = error.object[error.start]
        raise ValueError(
            f"{name!r} is not valid UTF-8 text (byte 0x{byte:02x} at position {error.start}: {error.reason})"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{name!r} holds text that is not JSON ({error})") from None


def decode_rows(table: pa.Table, columns: Sequence[str]) -> Iterator[dict[str, Any] | str]:
    """Each row of `table` as {column: value} for the named columns, in order, decoded when it is needed (a shard's
    rows are never all in Python at once); a row with a cell that cannot be decoded is its error message instead."""
    arrays = {name: table.column(name) for name in columns}
    for row in range(table.num_rows):
        try:
            yield {name: decode_cell(array, row, name) for name, array in arrays.items()}
        except ValueError as error:
            yield str(error)
