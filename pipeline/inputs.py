"""Read the input dataset with Hugging Face `datasets` and check its columns before any worker starts."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import datasets

from pipeline.remote import is_remote, local_copy

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
        return sorted(glob.glob(source, recursive=True))
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
        raise ValueError(f"input {name!r}: cannot resolve the hub dataset's revision ({type(error).__name__}: "
                         f"{message}); give a local copy to run without the hub") from None  # fmt: skip


def load_rows(source: str, split: str = "train", revision: str | None = None) -> datasets.Dataset:
    """A `datasets.Dataset` from a hub name (at `revision`), a file / directory / glob of Parquet, JSONL or CSV, or
    save_to_disk."""
    if is_remote(source):  # s3://, gs://, …: copied through pyarrow.fs, then read like a local input
        source = local_copy(source)
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
    return datasets.load_dataset(_builder_for(files), data_files=files, split="train")


def check_columns(rows: datasets.Dataset, required: dict[str, str | None], reserved: tuple[str, ...]) -> None:
    """Every named column exists, and no input column would collide with an output column."""
    present = list(rows.column_names)
    for flag, column in required.items():
        if column is not None and column not in present:
            raise ValueError(f"{flag} {column!r} is not a column of the input; columns: {present}")
    clash = sorted(set(present) & set(reserved))
    if clash:
        raise ValueError(f"input columns {clash} collide with output columns; rename them (reserved: {list(reserved)})")
