"""Files on disk: streaming safetensors, and files and directories that appear atomically.

``safetensors.torch.save_file`` serialises a whole dict in memory; an export or a checkpoint
shard must instead hold one tensor at a time. The format is simple (an 8-byte header length,
a JSON header of dtypes, shapes and byte offsets, then the raw bytes), so the header is
written from the planned entries first and the tensors follow as they arrive. Files are
read back with the ``safetensors`` library itself, which never unpickles anything.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import CheckpointError

DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how descriptions and the CLI spell a dtype."""
    return str(dtype).removeprefix("torch.")


DTYPES = {dtype_name(dtype): dtype for dtype in DTYPE_CODES}


@dataclass(frozen=True)
class Entry:
    """A tensor to be written: its key, dtype and shape (its bytes come later)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` under a temporary name; it appears, complete and synced, only on success."""
    temporary = path.with_name(f".{path.name}.incomplete")
    with open(temporary, "wb") as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def commit_directory(staging: Path, target: Path) -> None:
    """Move a complete staging directory into place; an existing ``target`` is replaced.

    A crash between the two renames of a replacement leaves the previous version complete
    under ``.<name>.replaced``, where ``checkpoint.resolve`` finds it.
    """
    if target.exists():
        replaced = target.with_name(f".{target.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(target, replaced)
        os.replace(staging, target)
        shutil.rmtree(replaced)
    else:
        os.replace(staging, target)
    fsync_dir(target.parent)


def staging_path(target: Path) -> Path:
    """Where ``target`` is written before it is committed: ``.<name>.incomplete`` beside it."""
    return target.with_name(f".{target.name}.incomplete")


def fresh_staging(target: Path) -> Path:
    """An empty staging directory for ``target``."""
    staging = staging_path(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _header(entries: Sequence[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPE_CODES:
            raise TypeError(f"{entry.key!r}: safetensors cannot hold {entry.dtype}")
        header[entry.key] = {
            "dtype": DTYPE_CODES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(encoded)) + encoded


def _write_tensor(handle: BinaryIO, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel():
        handle.write((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr()))  # no copy


def write_safetensors(
    path: Path,
    entries: Sequence[Entry],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``tensors`` (one per entry, in order, produced lazily) to ``path`` atomically."""
    with atomic_file(path) as handle:
        handle.write(_header(entries, metadata))
        stream = iter(tensors)
        for entry in entries:
            tensor = next(stream)
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(
                    f"{entry.key!r}: got {tensor.dtype} {tuple(tensor.shape)}, planned {entry.dtype} {entry.shape}"
                )
            _write_tensor(handle, tensor)
            del tensor  # let it go before the next one is produced


def open_safetensors(path: Path):
    """``safetensors.safe_open`` with errors that name the file."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file {path}")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own error types for bad headers and sizes
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or foreign?): {error}") from error
