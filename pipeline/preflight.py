"""Checks on the model (and draft model) that run on the driver, in seconds, before any worker starts.

A worker that cannot load its model fails far from the user, on another node, after the cluster has found room for
it. Everything that can be known from the files is checked here instead: the path or repo id resolves, config.json
parses and names a supported `model_type`, every weight file the index names exists, and every safetensors header
parses, is not cut short (an interrupted download) and holds the tensors the architecture expects. Failures raise
`ValueError` with one line naming the model and the problem; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from workers.model import SUPPORTED_MODEL_TYPES, HybridConfig

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_model(
    model: str, role: str = "model", need_tokenizer: bool = True, need_mtp: bool = False, revision: str | None = None
) -> str | None:
    """Check a local model directory or hub repo id; `ValueError` with one line naming `role` and the problem.
    `need_mtp`: the checkpoint must also carry a multi-token-prediction head (`--speculative mtp`). A hub repo is
    checked at the commit `revision` (branch, tag or commit; default main) points to now, which is returned, so
    that every worker loads what was checked; a local directory returns None."""
    try:
        if not looks_local(model):
            return _check_hub_repo(model, need_mtp, revision)
        if revision is not None:
            raise ValueError(f"--revision {revision!r} is for hub repo ids, not a local model directory")
        _check_directory(Path(model).expanduser(), need_tokenizer, need_mtp)
        return None
    except ValueError as error:
        raise ValueError(f"{role} {model!r}: {_one_line(str(error))}") from None


def looks_local(model: str) -> bool:
    """A path (existing, or written like one) rather than a hub repo id 'org/name'."""
    return os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") != 1


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines)


def _check_directory(directory: Path, need_tokenizer: bool, need_mtp: bool) -> None:
    if not directory.exists():
        raise ValueError("does not exist (give a model directory or a hub repo id 'org/name')")
    if not directory.is_dir():
        raise ValueError("is a file, not a model directory")
    config = _parse_config(directory / "config.json")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in weight_files(directory):
        shapes.update(read_safetensors_header(directory / name))
    _check_tensors(config, shapes)
    if need_mtp:
        from workers.model.loader import check_mtp_head

        check_mtp_head(config, shapes, directory)
    if need_tokenizer and not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"has no tokenizer files ({' or '.join(TOKENIZER_FILES)}): cannot turn text into tokens")


def _parse_config(path: Path) -> HybridConfig:
    if not path.exists():
        raise ValueError(f"has no config.json (found: {sorted(p.name for p in path.parent.iterdir())[:10]})")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"config.json does not parse: {error}") from None
    return hybrid_config(raw)


def hybrid_config(raw: Any) -> HybridConfig:
    if not isinstance(raw, dict):
        raise ValueError("config.json is not a JSON object")
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {raw.get('model_type')!r} (architectures={raw.get('architectures')}); "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        return HybridConfig.from_hf_dict(raw)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"config.json of model_type {raw['model_type']!r} cannot be read: {type(error).__name__}: {error}"
        ) from None


def weight_files(directory: Path) -> list[str]:
    """The safetensors files the checkpoint consists of; each must exist."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index.name} does not parse: {type(error).__name__}: {error}") from None
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise ValueError(
                f"{len(missing)} of the {len(files)} weight files named in {index.name} are missing: "
                f"{missing[:5]} (an interrupted download?)"
            )
        return files
    if (directory / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError("has no model.safetensors or model.safetensors.index.json (hybridgen loads safetensors only)")


def read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from a safetensors file's header; `ValueError` if the header or the file is cut short."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(
                f"{path.name} is {size} bytes, too short for a safetensors file (an interrupted download?)"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{path.name}: header of {header_len} bytes does not fit in the file's {size} bytes "
                "(truncated or not a safetensors file)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path.name}: safetensors header does not parse: {error}") from None
    return _header_shapes(header, path.name, size - 8 - header_len)


def _header_shapes(header: Any, name: str, data_bytes: int | None) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape; checks the data offsets against the bytes present when `data_bytes` is known."""
    if not isinstance(header, dict):
        raise ValueError(f"{name}: safetensors header is not a JSON object")
    shapes, end = {}, 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            shapes[key] = tuple(int(n) for n in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"{name}: safetensors header entry {key!r} is malformed") from None
    if data_bytes is not None and end > data_bytes:
        raise ValueError(
            f"{name} is truncated: its header describes {end} bytes of tensor data, the file holds "
            f"{data_bytes} (an interrupted download?)"
        )
    return shapes


def _check_tensors(config: HybridConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The tensors the architecture needs are all there, with the right shapes (same rule as the loader)."""
    import torch

    from workers.model.layers.hybrid import HybridModel
    from workers.model.loader import match_weights

    with torch.device("meta"):
        model = HybridModel(config)
    match_weights(model, shapes)


def _check_hub_repo(repo: str, need_mtp: bool, revision: str | None) -> str:
    """A hub repo at the commit `revision` resolves to (returned): config.json and the safetensors headers, fetched
    without downloading any weights."""
    import huggingface_hub

    try:
        commit = huggingface_hub.HfApi().model_info(repo, revision=revision).sha
        raw = json.loads(Path(huggingface_hub.hf_hub_download(repo, "config.json", revision=commit)).read_text())
        config = hybrid_config(raw)
        metadata = huggingface_hub.get_safetensors_metadata(repo, revision=commit)
    except ValueError:
        raise
    except Exception as error:  # network, auth, missing repo or file: all reported the same way
        message = _one_line(str(error))[:300]
        raise ValueError(f"cannot be read from the hub: {type(error).__name__}: {message}") from None
    shapes: dict[str, tuple[int, ...]] = {}
    for file_metadata in metadata.files_metadata.values():
        shapes.update({key: tuple(info.shape) for key, info in file_metadata.tensors.items()})
    _check_tensors(config, shapes)
    if need_mtp:
        from workers.model.loader import check_mtp_head

        check_mtp_head(config, shapes, repo)
    return commit
