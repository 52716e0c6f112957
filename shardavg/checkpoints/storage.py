"""Files on disk: streaming safetensors, read and written without mapping, and atomic files and folders.

``safetensors.torch.save_file`` serialises a whole dict in memory; an export or a checkpoint
shard must instead hold one tensor at a time. The format is simple (an 8-byte header length,
a JSON header of dtypes, shapes and byte offsets, then the raw bytes), so the header is
written from the planned entries first and the tensors follow as they arrive, hashed as they
are written. Reading is the same in reverse: the header is checked whole (as the
``safetensors`` library checks it), then exactly the bytes asked for are read with positioned
reads from one open descriptor, straight into the destination tensor. Nothing is mapped, so
memory holds what was read and no more, and a file opened once stays the same file while it
is read, whatever is renamed or removed around it. Nothing is ever unpickled.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..base.dtypes import CODE_DTYPES, DTYPE_CODES, DTYPES
from ..base.errors import CheckpointError
from ..base.validate import is_count
from ..layouts.parts import box_range, contiguous_strides
from .description import FileDigest

HEADER_LIMIT = 2**27  # bytes of JSON header a reader accepts (the safetensors library's own bound is 100 MB)
READ_PIECE = 16 * 2**20  # bytes read at a time when a range must be converted on its way in


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


class _HashingWriter:
    """Writes through to ``handle`` and hashes what it writes."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.hash, self.size = handle, hashlib.sha256(), 0

    def write(self, data: Any) -> None:
        self.handle.write(data)
        self.hash.update(data)
        self.size += memoryview(data).nbytes

    def digest(self) -> FileDigest:
        return FileDigest(self.size, self.hash.hexdigest())


def open_exclusive(path: Path) -> BinaryIO:
    """A new file at ``path`` for writing, created here: never through a link, never someone's file.

    A regular file already at the name is an earlier write's leftover (temporary names are
    shardavg's by their ``.NAME.incomplete`` form) and is replaced; anything else is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.fdopen(os.open(path, flags, 0o644), "wb")
    except FileExistsError:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise CheckpointError(
                f"{path} is in the way of a temporary file shardavg writes and is not a regular file "
                "(a link?): shardavg will not write through it; move it"
            ) from None
        os.unlink(path)  # a leftover of an interrupted write, shardavg's own by its name
        return os.fdopen(os.open(path, flags, 0o644), "wb")


@contextmanager
def staged_file(path: Path) -> Iterator[BinaryIO]:
    """Write ``path``'s temporary name (``staging_path``), complete and synced, and leave it there
    for the caller to move into place (``commit_file``); removed when the write fails."""
    temporary = staging_path(path)
    try:
        with open_exclusive(temporary) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        discard_staged(path)
        raise


def commit_file(path: Path) -> None:
    """Move the complete temporary file of ``path`` into place, replacing what was there."""
    os.replace(staging_path(path), path)
    fsync_dir(path.parent)


def discard_staged(path: Path) -> None:
    """Remove the temporary file of ``path``, if a write left one (never through a link)."""
    temporary = staging_path(path)
    if temporary.is_file() and not temporary.is_symlink():
        temporary.unlink()


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` under a temporary name; it appears, complete and synced, only on success."""
    with staged_file(path) as handle:
        yield handle
    commit_file(path)


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


def commit_folder(staging: Path, target: Path) -> None:
    """Move a complete staging folder into place, replacing ``target`` (empty, or proved to be
    shardavg's own by the caller) in one atomic exchange; the previous version is then removed.

    Where the exchange is unsupported, two renames: a crash between them leaves the previous
    version complete under ``.<name>.replaced``, which ``load`` reports rather than uses.
    """
    if not target.exists() or not any(target.iterdir()):
        os.replace(staging, target)  # a rename may replace an empty folder
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # now the previous version
    else:
        replaced = replaced_path(target)
        os.replace(target, replaced)
        os.replace(staging, target)
        shutil.rmtree(replaced)
    fsync_dir(target.parent)


INCOMPLETE = ".incomplete"  # the suffix of what is written before it is committed


def staging_path(target: Path) -> Path:
    """Where ``target`` (a file or a folder) is written before it is committed:
    ``.<name>.incomplete`` beside it."""
    return target.with_name(f".{target.name}{INCOMPLETE}")


def safetensors_header(entries: Sequence[Entry], metadata: dict[str, str] | None) -> bytes:
    """The bytes before the data of a safetensors file of ``entries`` in order: the header's length,
    its JSON (each entry's offsets), padded to 8 bytes as safetensors aligns the data."""
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


def _write_tensor(handle: Any, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel():
        handle.write((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr()))  # no copy


def write_safetensors(
    path: Path,
    entries: Sequence[Entry],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
    staged: bool = False,
) -> FileDigest:
    """Write ``tensors`` (one per entry, in order, produced lazily) to ``path`` atomically (with
    ``staged``, complete under its temporary name, for ``commit_file`` to move into place with the
    other files of one write); returns the file's size and SHA-256, computed as it was written."""
    with staged_file(path) if staged else atomic_file(path) as handle:
        writer = _HashingWriter(handle)
        writer.write(safetensors_header(entries, metadata))
        stream = iter(tensors)
        for entry in entries:
            tensor = next(stream)
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(
                    f"{entry.key!r}: got {tensor.dtype} {tuple(tensor.shape)}, planned {entry.dtype} {entry.shape}"
                )
            _write_tensor(writer, tensor)
            del tensor  # let it go before the next one is produced
    return writer.digest()


def open_regular(
    name: str | Path, dir_fd: int | None = None, where: str | Path | None = None, follow_links: bool = False
) -> int:
    """A read-only descriptor of the regular file ``name`` (relative to ``dir_fd`` when given;
    ``where`` names it in errors): never through a link (unless ``follow_links``: a model read
    from the Hugging Face cache, whose files are links to its blobs), never a pipe or a device
    (opening does not block on a FIFO). A missing file raises FileNotFoundError."""
    flags = os.O_RDONLY | (0 if follow_links else os.O_NOFOLLOW) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    where = name if where is None else where
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"{where} is a link, which is not a regular file: refused") from None
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointError(f"cannot open {where}: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{where} is not a regular file: refused")
    return fd


def read_bounded(
    name: str | Path,
    limit: int,
    too_large: Callable[[int], Exception],
    dir_fd: int | None = None,
    where: str | Path | None = None,
    follow_links: bool = False,
) -> bytes:
    """The whole regular file ``name`` (opened as ``open_regular`` does), or ``too_large(size)``
    raised when it holds more than ``limit`` bytes: its size is checked before anything is read,
    and no more than ``limit + 1`` bytes are read (a file that grows meanwhile is refused too), so
    a crafted file never costs more memory than the limit (a file of its size, no more)."""
    fd = open_regular(name, dir_fd, where, follow_links)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(fd).st_size
        if size > limit:
            raise too_large(size)
        data = handle.read(size + 1)  # (a buffer of the file's size: read(n) allocates n first)
        if len(data) > size:  # it grew since: read on, up to the limit
            data += handle.read(limit + 1 - len(data))
    if len(data) > limit:
        raise too_large(len(data))
    return data


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def numel(self) -> int:
        return (self.end - self.begin) // self.dtype.itemsize


class SafetensorsFile:
    """A safetensors file opened once and read with positioned reads (see the module docstring).

    The header is checked whole when the file is opened: a JSON object, known dtypes, shapes
    that match their byte ranges, and ranges that tile the data exactly up to the file's end.
    ``where`` names the file in every error."""

    def __init__(self, fd: int, where: str) -> None:
        """Takes ``fd`` over: it is closed with this object, or here if the header is refused."""
        try:
            self._file = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        self.where = where
        try:
            self.size = os.fstat(fd).st_size
            self.metadata, self.tensors = self._parse_header()
        except BaseException:
            self._file.close()
            raise

    @classmethod
    def open(
        cls, path: str | Path, dir_fd: int | None = None, where: str | Path | None = None, follow_links: bool = False
    ) -> SafetensorsFile:
        """Open ``path`` (a name inside ``dir_fd`` when given; ``where`` names it in errors; see
        ``open_regular`` for ``follow_links``); a missing file raises FileNotFoundError."""
        where = path if where is None else where
        return cls(open_regular(path, dir_fd, where, follow_links), str(where))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _invalid(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.where} is not a readable safetensors file (truncated or foreign?): {what}")

    def _parse_header(self) -> tuple[dict[str, str], dict[str, StoredTensor]]:
        if self.size < 8:
            raise self._invalid(f"{self.size} bytes, shorter than the header length")
        (length,) = struct.unpack("<Q", self._pread(0, 8))
        if length > min(self.size - 8, HEADER_LIMIT):
            raise self._invalid(f"a header of {length} bytes in a {self.size}-byte file")
        try:
            header = json.loads(self._pread(8, length))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise self._invalid(f"the header is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._invalid("the header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._invalid("__metadata__ is not a map of strings")
        data_start, tensors = 8 + length, {}
        for key, entry in header.items():
            tensors[key] = self._entry(key, entry, data_start)
        position = data_start
        for stored in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
            if stored.begin != position:
                raise self._invalid(
                    f"tensor data at byte {stored.begin - data_start}, expected {position - data_start}"
                )
            position = stored.end
        if position != self.size:
            raise self._invalid(f"the tensors end at byte {position}, the file at {self.size}")
        return metadata, tensors

    def _entry(self, key: str, entry: Any, data_start: int) -> StoredTensor:
        if not isinstance(entry, dict):
            raise self._invalid(f"{key!r} is not described by an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in CODE_DTYPES:
            raise self._invalid(f"{key!r} has dtype {str(dtype)[:40]!r}, not one shardavg reads")
        counts = (shape or []) + (offsets or [])
        if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2) or not all(
            is_count(n) and n < 2**63 for n in counts
        ):
            raise self._invalid(f"{key!r} has shape {str(shape)[:80]} and offsets {str(offsets)[:80]}")
        numel = 0 if 0 in shape else 1
        for dim in shape if numel else ():
            numel *= dim
            if numel > self.size:  # (anyone's shape: [2**62] * 100,000 would multiply for minutes)
                raise self._invalid(f"{key!r}: shape {str(shape)[:80]} holds more elements than the file has bytes")
        if offsets[1] - offsets[0] != numel * CODE_DTYPES[dtype].itemsize:
            raise self._invalid(f"{key!r}: shape {str(shape)[:80]} does not fill bytes {offsets}")
        return StoredTensor(CODE_DTYPES[dtype], tuple(shape), data_start + offsets[0], data_start + offsets[1])

    def checked(self, key: str, dtype: str, length: int) -> StoredTensor:
        """Tensor ``key``, checked to be ``length`` elements of ``dtype`` (a description's spelling), flat."""
        stored = self.tensors.get(key)
        if stored is None:
            raise CheckpointError(f"{self.where} lacks tensor {key!r}")
        if (stored.dtype, stored.shape) != (DTYPES[dtype], (length,)):
            found, expected = (DTYPE_CODES[stored.dtype], list(stored.shape)), (DTYPE_CODES[DTYPES[dtype]], [length])
            raise CheckpointError(f"{self.where}: {key!r} is {found}, the manifest says {expected}")
        return stored

    def read(self, key: str, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``[first, first + count)`` of the flattened tensor ``key``, as a new CPU tensor."""
        stored = self.tensors[key]
        count = stored.numel - first if count is None else count
        out = torch.empty(count, dtype=stored.dtype)
        self.read_into(out, key, first)
        return out

    def read_into(self, out: torch.Tensor, key: str, first: int = 0) -> None:
        """Fill ``out`` (1-D) with elements ``[first, first + out.numel())`` of tensor ``key``: read
        straight into it when it is contiguous on the CPU in the stored dtype, else a bounded piece
        at a time, converted on the way."""
        stored = self.tensors[key]
        if first < 0 or first + out.numel() > stored.numel:
            raise CheckpointError(f"{self.where}: elements {first}..{first + out.numel()} of {key!r} do not exist")
        size = stored.dtype.itemsize
        if out.dtype == stored.dtype and out.device.type == "cpu" and out.is_contiguous():
            if out.numel():
                buffer = (ctypes.c_ubyte * (out.numel() * size)).from_address(out.data_ptr())
                self._pread_into(memoryview(buffer).cast("B"), stored.begin + first * size)
            return
        step = max(1, READ_PIECE // size)
        for start in range(0, out.numel(), step):
            count = min(step, out.numel() - start)
            piece = torch.empty(count, dtype=stored.dtype)
            self.read_into(piece, key, first + start)
            out[start : start + count].copy_(piece)

    def read_box(self, out: torch.Tensor, key: str, at: int, sizes: Sequence[int], offsets: Sequence[int]) -> None:
        """Fill ``out`` with the box ``offsets .. offsets + out.shape`` of the row-major array of shape
        ``sizes`` stored from element ``at`` of tensor ``key``: straight into ``out`` when the box is
        back to back in the file and ``out`` is contiguous, else one read per piece of at most
        ``READ_PIECE`` bytes (halving the box along its first dim until a piece fits)."""
        if not out.numel():
            return
        flat = box_range(sizes, offsets, out.shape)
        if flat is not None and out.is_contiguous():
            self.read_into(out.view(-1), key, at + flat[0])
            return
        strides = contiguous_strides(sizes)
        first = sum(o * s for o, s in zip(offsets, strides))
        reach = sum((n - 1) * s for n, s in zip(out.shape, strides)) + 1  # elements from the box's first to its last
        split = next((d for d, n in enumerate(out.shape) if n > 1), None)
        if reach * self.tensors[key].dtype.itemsize <= READ_PIECE or split is None:
            out.copy_(self.read(key, at + first, reach).as_strided(tuple(out.shape), strides))
            return
        half = out.shape[split] // 2
        for low, count in ((0, half), (half, out.shape[split] - half)):
            moved = list(offsets)
            moved[split] += low
            self.read_box(out.narrow(split, low, count), key, at, sizes, moved)

    def sha256(self) -> str:
        """The SHA-256 of the whole file, read a bounded piece at a time."""
        digest, position = hashlib.sha256(), 0
        while position < self.size:
            data = self._pread(position, min(READ_PIECE, self.size - position))
            digest.update(data)
            position += len(data)
        return digest.hexdigest()

    def _pread(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self._pread_into(memoryview(buffer), offset)
        return bytes(buffer)

    def _pread_into(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < len(buffer):
            got = os.preadv(self._file.fileno(), [buffer[done:]], offset + done)
            if got == 0:
                raise self._invalid(
                    f"it ends at byte {offset + done}, before the {len(buffer)} bytes read from {offset}"
                )
            done += got


def safetensors_metadata(path: Path) -> dict:
    """The ``__metadata__`` of a safetensors file (a regular file, its header checked whole)."""
    with SafetensorsFile.open(path) as file:
        return file.metadata
