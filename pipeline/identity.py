"""Identities of what decides a job's output — the model, its tokenizer, a draft model, the input rows — computed
on the driver before any worker starts.

A rerun on the same `--output` resumes only when these are unchanged (they are part of the resume fingerprint,
so a mismatch names what changed). Weights are fingerprinted by each safetensors file's size, a hash of its header
(tensor names, dtypes, shapes, offsets) and hashes of blocks sampled evenly through its data: a retrained,
re-quantised or truncated checkpoint changes them, while reading them costs a few seeks per file. Input files are
hashed whole (every row decides the output; reading them is cheap next to generating from them), a hub dataset
is identified by its commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import datasets

from pipeline.inputs import input_files
from pipeline.preflight import weight_files

# Files besides the weights that change what a model generates.
MODEL_TEXT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")  # fmt: skip
NUM_SAMPLED_BLOCKS = 16
BLOCK_BYTES = 64 * 1024
HASH_CHUNK_BYTES = 8 << 20


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sampled_blocks_sha256(path: Path, start: int, size: int) -> str:
    """Hash of NUM_SAMPLED_BLOCKS blocks spread evenly over bytes [start, size) of a file (first and last included)."""
    digest = hashlib.sha256()
    span = max(0, size - start - BLOCK_BYTES)
    with path.open("rb") as f:
        for i in range(NUM_SAMPLED_BLOCKS):
            f.seek(start + span * i // (NUM_SAMPLED_BLOCKS - 1))
            digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()


def safetensors_identity(path: Path) -> dict[str, Any]:
    """Size, header hash and sampled-data hash of one safetensors file; `ValueError` when it is not one."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            raise ValueError(f"{path} is not a complete safetensors file ({size} bytes)")
        header = f.read(header_len)
    return {
        "bytes": size,
        "header_sha256": _sha256(header),
        "data_sha256_sampled": _sampled_blocks_sha256(path, 8 + header_len, size),
    }


def _local_model_identity(directory: Path) -> dict[str, Any]:
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"model directory {str(directory)!r} has no config.json")
    config = json.loads((directory / "config.json").read_text())
    files = {
        name: {"sha256": _sha256((directory / name).read_bytes())}
        for name in (*MODEL_TEXT_FILES, *TOKENIZER_FILES)
        if (directory / name).is_file()
    }
    for name in weight_files(directory):  # the files preflight checked (each exists, the index parses)
        files[name] = safetensors_identity(directory / name)
    return {"model_type": config.get("model_type"), "files": files}


def _hub_model_identity(repo_id: str, revision: str | None) -> dict[str, Any]:
    """A hub repo at `revision`: the content hash of every file the loader reads, as the hub reports them (no
    download). Not the commit: a push that changes only other files (a README) leaves the output as it was."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    relevant = (*MODEL_TEXT_FILES, *TOKENIZER_FILES)
    files = {}
    for sibling in info.siblings or []:
        name = sibling.rfilename
        if (name.endswith(".safetensors") and "/" not in name) or name in relevant:  # the loader reads the top level
            lfs = sibling.lfs
            files[name] = {"bytes": sibling.size, "sha256": lfs.sha256 if lfs else None, "blob_id": sibling.blob_id}
    model_type = (info.config or {}).get("model_type") if isinstance(info.config, dict) else None
    return {"model_type": model_type, "files": files}


def model_identity(model: str, revision: str | None = None) -> dict[str, Any]:
    """What identifies a model's output: config, generation config, tokenizer files and weights (see module doc);
    a hub repo's at `revision` (the commit the driver pinned)."""
    if os.path.isdir(model):
        return {"model": model, **_local_model_identity(Path(model))}
    if os.path.exists(model) or model.count("/") != 1:
        raise ValueError(f"model {model!r} is neither a model directory nor a hub repo id ('org/name')")
    return {"model": model, **_hub_model_identity(model, revision)}


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's whole content, read in blocks of HASH_CHUNK_BYTES."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _file_key(path: str, source: str) -> str:
    """A data file's name in the identity: relative to a directory input (so a remote input's copy, in a new
    temporary directory each run, keeps its names), the file name of a one-file input, a glob's match as is."""
    if os.path.isdir(source):
        return os.path.relpath(path, source)
    return os.path.basename(path) if os.path.isfile(source) else path


def input_identity(rows: datasets.Dataset, source: str, revision: str | None = None) -> dict[str, Any]:
    """Row count, features and what the rows were read from: the size and whole-content sha256 of each local data
    file (`source` local: a remote input's copy), or the commit `revision` of a hub dataset."""
    files = {
        _file_key(name, source): {"bytes": os.path.getsize(name), "sha256": file_sha256(name)}
        for name in input_files(source) or []
    }
    return {"num_rows": len(rows), "features": str(rows.features), "files": files, "revision": revision}
