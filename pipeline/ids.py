"""The output `id` column: the id column's values as written, one per row, checked before any worker starts.

Ids must tell rows apart: a duplicate or missing id would make two output rows indistinguishable (or one row
nameless), and nothing downstream could join the output back to its input. They are read as written — a CSV id
column is read as text (`"007"` stays `"007"`, never `7.0`), a JSONL column mixing numbers and strings keeps each
value's text (`7` → `"7"`, `"q-7"` → `"q-7"`) — and refused, naming a few, when some repeat or are missing.
"""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.compute as pc

NUM_SHOWN = 3  # duplicate ids a message names


def _is_json(type_: pa.DataType) -> bool:
    return getattr(type_, "extension_name", None) == "arrow.json"


def _as_written(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column `datasets` stored as JSON text (values of mixed types) as strings: a string as itself, any other
    value as its JSON text."""
    texts = column.cast(column.type.storage_type) if hasattr(column.type, "storage_type") else column
    values = []
    for text in texts.to_pylist():
        value = None if text is None else json.loads(text)
        values.append(value if value is None or isinstance(value, str) else text)
    return pa.chunked_array([pa.array(values, pa.string())])


def read_ids(rows: datasets.Dataset, id_column: str | None, flag: str) -> pa.ChunkedArray | None:
    """The output ids (None: the row index is the id); `ValueError` naming duplicate or missing ids. `flag` says
    where the column came from, for the message (`--id-column 'key'`, or the input's `id` column)."""
    if id_column is None:
        return None
    ids = rows.data.table.column(id_column)
    if _is_json(ids.type):
        ids = _as_written(ids)
    missing = pc.is_null(ids)
    if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
        missing = pc.or_kleene(missing, pc.equal(ids, ""))
    problems = []
    num_missing = pc.sum(missing).as_py() or 0
    if num_missing:
        problems.append(f"{num_missing} rows have no id (null or empty: {_rows_where(missing)})")
    counts = pc.value_counts(ids.drop_null())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        shown = [
            f"{value!r} ({_rows_where(pc.equal(ids, value))})"
            for value in repeated.field("values")[:NUM_SHOWN].to_pylist()
        ]
        more = ", …" if len(repeated) > NUM_SHOWN else ""
        problems.append(f"{len(repeated)} ids occur more than once: {', '.join(shown)}{more}")
    if problems:
        raise ValueError(
            f"{flag}: {'; '.join(problems)}; each row needs an id of its own: fix the input, name "
            "another column with --id-column, or leave the ids to the row index (an input column "
            "named `id` must then be renamed)"
        )
    return ids


def _rows_where(mask: pa.ChunkedArray) -> str:
    """'rows 0, 5, 9, …': the first NUM_SHOWN rows where `mask` holds."""
    where = pc.indices_nonzero(pc.fill_null(mask, False).combine_chunks()).to_pylist()
    return "rows " + ", ".join(map(str, where[:NUM_SHOWN])) + (", …" if len(where) > NUM_SHOWN else "")
