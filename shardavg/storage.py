"""Files on disk: streaming safetensors, and files and directories that appear atomically.

``safetensors.torch.save_file`` serialises a whole dict in memory; an export or a checkpoint
shard must instead hold one tensor at a time. The format is simple (an 8-byte header length,
a JSON header of dtypes, shapes and byte offsets, then the raw bytes), so the header is
written from the planned entries first and the tensors follow as they arrive. Files are
read back with the ``safetensors`` library itself, which never unpickles anything.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
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
    try:
        with open(temporary, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)
    fsync_dir(path.parent)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def replaced_path(target: Path) -> Path:
    """Where the two-rename fall-back keeps the previous ``target`` for a moment."""
    return target.with_name(f".{target.name}.replaced")


def commit_directory(staging: Path, target: Path) -> None:
    """Move a complete staging directory into place, replacing ``target`` (empty, or proved to be
    shardavg's own by the caller) in one atomic exchange; the previous version is then removed.

    Where the exchange is unsupported, two renames: a crash between them leaves the previous
    version complete under ``.<name>.replaced``, which ``load`` reports rather than uses.
    """
    if not target.exists() or not any(target.iterdir()):
        os.replace(staging, target)  # a rename may replace an empty directory
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # now the previous version
    else:
        replaced = replaced_path(target)
        os.replace(target, replaced)
        os.replace(staging, target)
        shutil.rmtree(replaced)
    fsync_dir(target.parent)


def staging_path(target: Path) -> Path:
    """Where ``target`` is written before it is committed: ``.<name>.incomplete`` beside it."""
    return target.with_name(f".{target.name}.incomplete")


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


def safetensors_metadata(path: Path) -> dict:
    """The ``__metadata__`` of a safetensors file, read from its header alone (nothing mapped)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > min(os.fstat(handle.fileno()).st_size, 2**27):
            raise ValueError(f"{path}: a {length}-byte header")
        header = json.loads(handle.read(length))
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def open_safetensors(path: Path):
    """``safetensors.safe_open`` on a regular file (never a link, pipe or device), with errors that name it."""
    from safetensors import safe_open

    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        raise CheckpointError(f"missing checkpoint file {path}") from None
    if not regular:
        raise CheckpointError(f"{path} is not a regular file: refused")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own error types for bad headers and sizes
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or foreign?): {error}") from error


def checked_slice(handle, path: Path, key: str, dtype: str, length: int):
    """The lazy slice ``key`` of an open file, checked to be ``length`` elements of ``dtype`` before any read."""
    if key not in handle.keys():
        raise CheckpointError(f"{path} lacks tensor {key!r}")
    piece = handle.get_slice(key)
    expected = (DTYPE_CODES[DTYPES[dtype]], [length])
    if (piece.get_dtype(), piece.get_shape()) != expected:
        found = (piece.get_dtype(), piece.get_shape())
        raise CheckpointError(f"{path}: {key!r} is {found}, the manifest says {expected}")
    return piece
