"""Read the input dataset with Hugging Face `datasets` and check its columns before any worker starts."""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.exceptions import DatasetGenerationError

from pipeline.remote import is_remote, local_copy, scratch_directory

# File suffix → `datasets` builder name.
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# save_to_disk of a Dataset / of a DatasetDict.
_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json")


def _builder_for(files: list[str]) -> str:
    suffixes = {Path(f).suffix.lower() for f in files}
    builders = {_BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise ValueError(
            f"cannot read input files with suffixes {sorted(suffixes)}: use one of {sorted(_BUILDERS)} (one kind at a time)"
        )
    return builders.pop()


def _is_saved_dataset(source: str) -> bool:
    return os.path.isdir(source) and any((Path(source) / name).exists() for name in _SAVED_MARKERS)


def input_files(source: str) -> list[str] | None:
    """The local files a local input's rows are read from (every file of a save_to_disk directory); None for a
    hub dataset name; `FileNotFoundError` for a path that does not exist."""
    if _is_saved_dataset(source):
        return sorted(str(p) for p in Path(source).rglob("*") if p.is_file())
    if os.path.isdir(source):
        return sorted(str(p) for p in Path(source).rglob("*") if p.suffix.lower() in _BUILDERS)
    if any(ch in source for ch in "*?["):
        return sorted(path for path in glob.glob(source, recursive=True) if os.path.isfile(path))  # `**` lists folders
    if os.path.exists(source):
        return [source]
    if source.startswith((".", "/", "~")) or Path(source).suffix.lower() in _BUILDERS:
        raise FileNotFoundError(f"input {source!r} does not exist")
    return None


def hub_dataset_revision(name: str) -> str:
    """The commit a hub dataset's default branch points to now; `ValueError` when the hub cannot say."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name).sha
    except Exception as error:  # network, auth, missing repo, offline mode: all reported the same way
        message = (str(error).splitlines() or [""])[0][:300]
        raise ValueError(
            f"input {name!r}: cannot resolve the hub dataset's revision ({type(error).__name__}: "
            f"{message}); give a local copy to run without the hub"
        ) from None


def load_rows(
    source: str,
    split: str = "train",
    revision: str | None = None,
    cache_dir: str | None = None,
    id_column: str | None = None,
) -> datasets.Dataset:
    """A `datasets.Dataset` from a hub name (at `revision`), a file / directory / glob of Parquet, JSONL or CSV, or
    save_to_disk. `cache_dir`: where `datasets` keeps its Arrow copy (default: its own cache). `id_column`: a CSV
    column read as written (text: "007" stays "007"), not type-inferred. An empty, unreadable or row-less input is a
    `ValueError` in one line naming it."""
    if is_remote(source):  # s3://, gs://, …: copied through pyarrow.fs, then read like a local input
        source, cache_dir = local_copy(source), cache_dir or scratch_directory("hybridgen-datasets-cache-")
    if _is_saved_dataset(source):
        loaded = datasets.load_from_disk(source)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"split {split!r} not in {source}; available: {sorted(loaded)}")
            loaded = loaded[split]
        return loaded
    files = input_files(source)
    if files is None:
        return datasets.load_dataset(source, split=split, revision=revision)  # a hub dataset name
    if not files:
        raise ValueError(f"no Parquet/JSONL/CSV files found for input {source!r}")
    rows = _load_files(source, files, cache_dir, id_column)
    if len(rows) == 0:
        raise ValueError(f"input {_named(source, files)} has no rows: give a file with at least one row")
    return rows


def _named(source: str, files: list[str]) -> str:
    """The input in messages: its one file, or the input and how many files it has."""
    return repr(files[0]) if len(files) == 1 else f"{source!r} ({len(files)} files)"


def _load_files(source: str, files: list[str], cache_dir: str | None, id_column: str | None) -> datasets.Dataset:
    """Local data files through one `datasets` builder; what makes them unreadable becomes one `ValueError` line."""
    builder = _builder_for(files)
    for name in files:
        _check_file(name, builder)
    options: dict = {"cache_dir": cache_dir}
    if builder == "csv":  # pandas would infer ids' types: "007" → 7 (and "7" → 7: a collision)
        options["converters"] = {id_column or "id": str}
    logger = logging.getLogger("datasets")  # it logs the failure too: the message below says it once
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **options)
    except (DatasetGenerationError, pa.ArrowException, ValueError, StopIteration) as error:
        reason = _reason(error)
        raise ValueError(f"input {_named(source, files)} cannot be read as {builder.upper()}: {reason}") from None
    finally:
        logger.setLevel(level)


def _check_file(name: str, builder: str) -> None:
    """`ValueError` for an empty file, and for a Parquet file that is not one or holds no rows (read from its
    footer; `datasets` fails on them with messages that name neither the file nor the problem)."""
    if os.path.getsize(name) == 0:
        raise ValueError(f"input file {name!r} is empty (0 bytes): remove it or give it rows")
    if builder != "parquet":
        return
    try:
        num_rows = pq.ParquetFile(name).metadata.num_rows
    except pa.ArrowException as error:
        raise ValueError(f"input file {name!r} is not a readable Parquet file ({_reason(error)})") from None
    if num_rows == 0:
        raise ValueError(f"input file {name!r} holds no rows: remove it or give it rows")


def _reason(error: BaseException) -> str:
    """The root cause of a failed read in one line, with what to do about text that is not UTF-8."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, StopIteration) or "corresponds to no data" in str(error):  # only blank lines
        return "it holds no rows"
    text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    if isinstance(error, UnicodeDecodeError) or "UTF8" in text or "UTF-8" in text:
        text += " (the file is not UTF-8 text: re-encode it as UTF-8)"
    return text


def check_columns(rows: datasets.Dataset, required: dict[str, str | None], reserved: tuple[str, ...]) -> None:
    """Every named column exists, and no input column would collide with an output column."""
    present = list(rows.column_names)
    for flag, column in required.items():
        if column is not None and column not in present:
            raise ValueError(f"{flag} {column!r} is not a column of the input; columns: {present}")
    clash = sorted(set(present) & set(reserved))
    if clash:
        raise ValueError(f"input columns {clash} collide with output columns; rename them (reserved: {list(reserved)})")
