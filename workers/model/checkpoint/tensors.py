"""Read a checkpoint's safetensors tensors one at a time, with plain file reads, and dequantize FP8 ones.

safetensors' own `safe_open` maps each file into memory; every page a read touches then counts in the process's
resident memory until the handle closes, so loading a model held its weights twice at the peak (the mapped file and
the model's copy; ~2× float32 weights on granite-4.0-h-1b shapes). Here each tensor is read with `pread` into a
fresh tensor, so the page cache holds the file, not this process.

Block-wise FP8 checkpoints (Qwen3-Next / Qwen3.5 FP8, DeepSeek-V3's layout: `quantization_config` {quant_method:
fp8, weight_block_size: [128, 128], modules_to_not_convert: [...]}) store a quantized weight as float8_e4m3fn
`W [out, in]` with `W_scale_inv [ceil(out / 128), ceil(in / 128)]`: the real weight is W · scale per 128 × 128
block. `CheckpointTensors` hides the scales and hands out the dequantized float32 weight under the weight's key;
the modules left unconverted simply have no scale and read as stored.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
MAX_HEADER_BYTES = 100 * 2**20
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
READ_CHUNK = 1 << 30  # bytes per pread (Linux reads at most ~2 GiB at once)


def fp8_block_size(raw_config: dict[str, Any]) -> tuple[int, int] | None:
    """The [rows, cols] weight block of a block-wise FP8 checkpoint's config.json, None for an unquantized one;
    `ValueError` for quantization methods hybridgen cannot load."""
    quantization = raw_config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != "fp8":
        raise ValueError(
            f"the checkpoint is quantized with quant_method={method!r}; hybridgen loads unquantized checkpoints and "
            "block-wise FP8 ones (quant_method 'fp8' with weight_scale_inv tensors)"
        )
    block = quantization.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(n, int) and n > 0 for n in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} is invalid: give [rows, cols]")
    return (block[0], block[1])


def without_scales(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Key → shape without the FP8 scale tensors that belong to a weight (what the model's parameters match)."""
    return {k: s for k, s in shapes.items() if not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in shapes)}


class _Entry:
    """Where one tensor lies: its file, dtype, shape and byte range."""

    __slots__ = ("path", "dtype", "shape", "begin", "end")

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.path, self.dtype, self.shape, self.begin, self.end = path, dtype, shape, begin, end


def _read_header(path: Path) -> dict[str, _Entry]:
    """A safetensors file's tensors; `ValueError` naming the file when its header or data range is malformed."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name} is {size} bytes, too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path.name}: header of {length} bytes does not fit in the file's {size} bytes")
        header = json.loads(f.read(length))
    start, entries = 8 + length, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = DTYPES[info["dtype"]], tuple(int(n) for n in info["shape"])
            begin, end = (start + int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path.name}: safetensors header entry {key!r} is malformed ({error})") from None
        expected = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if end - begin != expected or begin < start or end > size:
            raise ValueError(
                f"{path.name}: tensor {key!r} of shape {shape} needs {expected} bytes at offsets "
                f"{begin - start}…{end - start} of {size - start} bytes of data"
            )
        entries[key] = _Entry(path, dtype, shape, begin, end)
    return entries


class CheckpointTensors:
    """The tensors of a checkpoint's safetensors files, read on demand (no memory mapping).

    `shapes` maps every key a model may ask for to its shape (FP8 scales left out); `read(key)` returns a new CPU
    tensor, FP8 weights dequantized to float32 with their block scales; `read_rows(key, pieces)` only some rows of
    dim 0 (a tensor-parallel rank's share), reading only their bytes. `bytes_read` counts the bytes read so far.
    """

    def __init__(self, files: list[Path], fp8_block: tuple[int, int] | None = None):
        self._entries: dict[str, _Entry] = {}
        for path in files:
            self._entries.update(_read_header(path))
        self.fp8_block = fp8_block
        self.shapes = without_scales({key: entry.shape for key, entry in self._entries.items()})
        self.bytes_read = 0

    def keys(self) -> list[str]:
        """Every tensor a model may read (FP8 scales left out)."""
        return list(self.shapes)

    def __contains__(self, key: object) -> bool:
        return key in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def read(self, key: str) -> torch.Tensor:
        """The tensor stored under `key`; an FP8 weight with a `<key>_scale_inv` comes back dequantized (float32)."""
        entry = self._entries[key]
        tensor = self._raw(entry)
        scale_key = key + SCALE_SUFFIX
        if entry.dtype in FP8_DTYPES:
            if scale_key not in self._entries:
                raise ValueError(f"FP8 weight {key!r} has no {scale_key!r}: only block-wise FP8 checkpoints load")
            return self._dequantize(key, tensor, self._raw(self._entries[scale_key]))
        return tensor

    def read_dtype(self, key: str) -> torch.dtype:
        """The dtype `read(key)` returns (float32 for an FP8 weight, else the stored one); reads nothing."""
        return torch.float32 if self._entries[key].dtype in FP8_DTYPES else self._entries[key].dtype

    def read_rows(
        self, key: str, pieces: Sequence[tuple[int, int]], out: torch.Tensor | None = None, flat: int = 1
    ) -> torch.Tensor:
        """The rows `(start, length)` of `key`'s dim 0, concatenated in order, reading only their bytes (a row of an
        `[out, in]` weight, or an expert of an `[E, …]` stack, is contiguous); an FP8 weight's rows dequantized
        with their scale rows, to exactly the values `read(key)` gives them. `flat`: how many leading dims count
        as one (2: the rows of every expert of `[E, R, W]` as `[E·R, W]`). `out`: a contiguous CPU tensor of the
        result's shape and stored dtype to read into (used where it fits; the result is returned either way)."""
        entry = self._entries[key]
        shape = (sum(length for _, length in pieces), *entry.shape[flat:])
        ranges = _row_ranges(entry, pieces, math.prod(entry.shape[:flat]))
        if entry.dtype not in FP8_DTYPES:
            fits = out is not None and out.device.type == "cpu" and out.is_contiguous() and out.dtype == entry.dtype
            return self._raw(entry, out if fits and tuple(out.shape) == shape else None, ranges, shape)
        weight = self._raw(entry, None, ranges, shape)
        scale_entry = self._fp8_scale_entry(key)
        rows, cols = self.fp8_block or DEFAULT_BLOCK
        if weight.dim() != 2 or scale_entry.shape != _scale_shape(entry.shape, rows, cols):
            self.read(key)  # raises the ValueError that names the mismatch
        blocks = [(start // rows, -(-(start + length) // rows) - start // rows) for start, length in pieces]
        scale_shape = (sum(n for _, n in blocks), scale_entry.shape[1])
        scale = self._raw(scale_entry, None, _row_ranges(scale_entry, blocks, scale_entry.shape[0]), scale_shape)
        parts, first = [], 0  # each piece's scale rows, one per weight row
        for (start, length), (_, num_blocks) in zip(pieces, blocks):
            block_rows = scale.narrow(0, first, num_blocks).float().repeat_interleave(rows, 0)
            parts.append(block_rows.narrow(0, start % rows, length))
            first += num_blocks
        scale_rows = torch.cat(parts) if parts else scale.new_zeros((0, scale.shape[1]))
        return weight.float().mul_(scale_rows.repeat_interleave(cols, 1)[:, : entry.shape[1]])

    def read_fp8_rows(self, key: str, pieces: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The rows `(start, length)` of an FP8 weight as stored, e4m3 bytes as uint8, reading only their bytes."""
        entry = self._entries[key]
        if not self.is_fp8(key):
            raise ValueError(f"weight {key!r} is not a block-wise FP8 weight (e4m3 with {key + SCALE_SUFFIX!r})")
        shape = (sum(length for _, length in pieces), *entry.shape[1:])
        return self._raw(entry, None, _row_ranges(entry, pieces, entry.shape[0]), shape).view(torch.uint8)

    def read_scale(self, key: str) -> torch.Tensor:
        """An FP8 weight's float32 `scale_inv` per block."""
        return self._raw(self._fp8_scale_entry(key)).float()

    def _fp8_scale_entry(self, key: str) -> _Entry:
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self._entries:
            raise ValueError(f"FP8 weight {key!r} has no {scale_key!r}: only block-wise FP8 checkpoints load")
        return self._entries[scale_key]

    def is_fp8(self, key: str) -> bool:
        """Whether `key` is stored as a block-wise FP8 weight (e4m3 with a `<key>_scale_inv`)."""
        entry = self._entries.get(key)
        return entry is not None and entry.dtype == torch.float8_e4m3fn and key + SCALE_SUFFIX in self._entries

    def read_fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight as stored: (its e4m3 bytes as uint8 [N, K], its float32 scale_inv per block)."""
        if not self.is_fp8(key):
            raise ValueError(f"weight {key!r} is not a block-wise FP8 weight (e4m3 with {key + SCALE_SUFFIX!r})")
        return self._raw(self._entries[key]).view(torch.uint8), self._raw(self._entries[key + SCALE_SUFFIX]).float()

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """Read `key` straight into `out` (a contiguous CPU tensor of its shape and stored dtype: no temporary
        copy); False, reading nothing, when `out` is not such a tensor or the weight is FP8."""
        entry = self._entries[key]
        fits = out.device.type == "cpu" and out.is_contiguous() and out.dtype == entry.dtype
        if not fits or tuple(out.shape) != entry.shape or entry.dtype in FP8_DTYPES:
            return False
        self._raw(entry, out)
        return True

    def _raw(
        self,
        entry: _Entry,
        out: torch.Tensor | None = None,
        ranges: list[tuple[int, int]] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """`entry`'s bytes in `ranges` (file offsets `(begin, end)`; all of them by default), one after the other,
        as a tensor of `shape` (`entry.shape` by default), read into `out` when given."""
        out = torch.empty(shape or entry.shape, dtype=entry.dtype) if out is None else out
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(entry.path, "rb", buffering=0) as f:
            done = 0
            for begin, end in ranges or [(entry.begin, entry.end)]:
                position = begin
                while position < end:
                    chunk = buffer[done : done + min(end - position, READ_CHUNK)]
                    n = os.preadv(f.fileno(), [chunk], position)
                    if n <= 0:
                        raise ValueError(f"{entry.path.name} ends before its tensor data does (truncated?)")
                    done, position = done + n, position + n
        self.bytes_read += done
        return out

    def _dequantize(self, key: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """W · scale, each scale covering a block of `fp8_block` weights (the last blocks cut at the edges)."""
        rows, cols = self.fp8_block or DEFAULT_BLOCK
        if weight.dim() != 2:
            raise ValueError(f"FP8 weight {key!r} has shape {tuple(weight.shape)}; block scales need a matrix")
        out_features, in_features = weight.shape
        expected = _scale_shape(weight.shape, rows, cols)
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{key}{SCALE_SUFFIX} has shape {tuple(scale.shape)}, expected {expected} for a "
                f"{tuple(weight.shape)} weight in {rows} × {cols} blocks"
            )
        full = scale.float().repeat_interleave(rows, 0)[:out_features].repeat_interleave(cols, 1)[:, :in_features]
        return weight.float().mul_(full)


def _scale_shape(shape: Sequence[int], rows: int, cols: int) -> tuple[int, ...]:
    """The block scales' shape of a weight of `shape` in `rows` × `cols` blocks (the last blocks cut at the edges)."""
    return tuple(-(-n // b) for n, b in zip(shape, (rows, cols))) if len(shape) == 2 else ()


def _row_ranges(entry: _Entry, pieces: Sequence[tuple[int, int]], num_rows: int) -> list[tuple[int, int]]:
    """The file byte ranges of the rows `(start, length)` of `entry` seen as `num_rows` rows; `ValueError` for rows
    it lacks."""
    num_rows = num_rows if entry.shape else 0
    row_bytes = (entry.end - entry.begin) // max(num_rows, 1)
    ranges = []
    for start, length in pieces:
        if start < 0 or length < 0 or start + length > num_rows:
            raise ValueError(f"rows {start}…{start + length} are outside the {num_rows} rows of a {entry.shape} tensor")
        ranges.append((entry.begin + start * row_bytes, entry.begin + (start + length) * row_bytes))
    return ranges
