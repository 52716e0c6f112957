"""Reading an averager checkpoint in one process, without a process group, tensor by tensor.

Two layouts are understood: ``avg.save``'s (a ``shardavg.json`` manifest and one safetensors
file per rank) and the entry an averager wrote into a ``torch.distributed.checkpoint``
directory. DCP stores its ``.metadata`` as a pickle; it is read with an unpickler that only
builds DCP's own metadata classes, and tensors with ``torch.load(weights_only=True)``, so a
checkpoint carrying a malicious pickle is refused before anything in it runs.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .checkpoint import STEP_DIR, read_manifest, resolve
from .description import is_count, numel
from .errors import CheckpointError
from .layout import tiles
from .ownership import MANIFEST
from .state import tensor_key
from .stateful import decode_description
from .storage import DTYPES, checked_slice, open_safetensors

PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file inside the checkpoint, never a path

_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes and sizes; refuses every other global."""

    def __init__(self, file: io.BufferedReader, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} asks to load {module}.{name}, which a checkpoint has no business with: refused"
        )


class SavedAverage:
    """An averager's checkpoint opened for reading: ``description``, ``averages`` (their names,
    ``[None]`` for an averager with one rule) and ``read(name, average)``."""

    def __init__(self, path: str | Path, key: str = "ema") -> None:
        path = Path(path)
        if _regular(path / ".metadata"):
            self._open_dcp(path, key)
        elif not path.exists() or (path / MANIFEST).is_file() or any(STEP_DIR.match(p.name) for p in path.iterdir()):
            self.path = resolve(path)
            self.description = read_manifest(self.path)
            self.kind = "shardavg"
        else:
            raise CheckpointError(
                f"{path} is neither a shardavg checkpoint ({MANIFEST}) nor a DCP checkpoint (.metadata)"
            )
        self.tensors = {entry["name"]: entry for entry in self.description["tensors"]}
        self.averages: list[str | None] = [entry["name"] for entry in self.description["averages"]]
        self._handles: dict[Path, Any] = {}

    def average(self, name: str | None) -> str | None:
        """The average called ``name``; ``None`` picks the only one, when there is one."""
        if name is None and len(self.averages) == 1:
            return self.averages[0]
        if name not in self.averages:
            named = [n for n in self.averages if n is not None]
            raise CheckpointError(
                f"{self.path} holds averages {named}: name one (--average)"
                if name is None
                else f"{self.path} has no average {name!r}; it holds "
                + (f"{named}" if named else "one, unnamed: leave --average out")
            )
        return name

    def key(self, name: str, average: str | None) -> str:
        """The key tensor ``name`` of ``average`` is stored under."""
        return tensor_key(average, name) if self.tensors[name]["role"] == "average" else name

    # --------------------------------------------------------------- DCP

    def _open_dcp(self, path: Path, key: str) -> None:
        where = str(path / ".metadata")
        try:
            with open(path / ".metadata", "rb") as handle:
                self._metadata = _MetadataUnpickler(handle, where).load()
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(f"cannot read {where}: {error}") from error
        self.path, self.kind, self._prefix = path, "dcp", f"{key}."
        entries = getattr(self._metadata, "state_dict_metadata", None)
        if not isinstance(entries, dict) or not isinstance(getattr(self._metadata, "storage_data", None), dict):
            raise CheckpointError(f"{where} is not DCP metadata")
        if f"{key}.meta" not in entries:
            found = sorted({str(name).split(".")[0] for name in entries})
            raise CheckpointError(f"{path} has no averager under key {key!r} (top-level keys: {found})")
        meta = self._dcp_item(f"{key}.meta", None, limit=64 * 2**20)
        self.description = decode_description(meta, f"{path} [{key}]")

    def _dcp_location(self, fqn: str, offset: Any, limit: int) -> tuple[Path, int, int]:
        """Where DCP stored an item: a regular file inside the checkpoint, at most ``limit`` bytes,
        within the file. Checked before anything is read."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._metadata.storage_data.get(MetadataIndex(fqn, offset))
        if info is None:
            raise CheckpointError(f"{self.path}: no stored data for {fqn} at {offset}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{self.path}: {fqn} is stored with transforms {info.transform_descriptors}, unsupported"
            )
        name, start, length = (getattr(info, key, None) for key in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and PLAIN_NAME.match(name) and is_count(start) and is_count(length)):
            raise CheckpointError(f"{self.path}: {fqn} is stored at {name!r} [{start!r}, +{length!r}), refused")
        file = self.path / name
        if not _regular(file):
            raise CheckpointError(f"{file} is missing or not a regular file: refused")
        size = file.stat().st_size
        if length > limit or start + length > size:
            raise CheckpointError(
                f"{file}: {fqn} claims bytes {start}..{start + length} of a {size}-byte file (at most {limit} expected)"
            )
        return file, start, length

    def _dcp_item(self, fqn: str, offset: Any, limit: int) -> Any:
        """One item DCP stored, loaded with ``torch.load(weights_only=True)``: no Python objects."""
        file, start, length = self._dcp_location(fqn, offset, limit)
        try:
            with open(file, "rb") as handle:
                handle.seek(start)
                data = handle.read(length)
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:  # torch.load refuses anything but tensors and plain containers
            raise CheckpointError(f"cannot read {fqn} from {file}: {error}") from error

    # --------------------------------------------------------------- reading

    def verify(self) -> None:
        """Check every tensor's chunk table against the files it names, reading no tensor data."""
        for name in self.tensors:
            for average in self.averages:
                self._chunks(name, self.key(name, average))

    def read(self, name: str, average: str | None = None) -> torch.Tensor:
        """The full tensor ``name`` of ``average`` in its original shape (one tensor in memory at a time).

        Every stored chunk is checked (where it lies, that the chunks tile the tensor, dtype and
        size) before the tensor is allocated, so a damaged table never yields unwritten memory.
        """
        key = self.key(name, self.average(average))
        dtype, shape = DTYPES[self.tensors[name]["dtype"]], torch.Size(self.tensors[name]["shape"])
        flat = torch.empty(shape.numel(), dtype=dtype)
        for start, length, value in self._chunks(name, key):
            piece = value()
            if not isinstance(piece, torch.Tensor) or piece.dtype != dtype or piece.shape != (length,):
                found = f"{piece.dtype} {tuple(piece.shape)}" if isinstance(piece, torch.Tensor) else type(piece)
                raise CheckpointError(f"{self.path}: a chunk of {key!r} is {found}, expected {dtype} ({length},)")
            flat[start : start + length] = piece
        return flat.view(shape)

    def _chunks(self, name: str, key: str) -> list[tuple[int, int, Callable[[], Any]]]:
        """``(start, length, read)`` for each chunk stored under ``key`` of tensor ``name``, checked to tile it."""
        entry = self.tensors[name]
        if self.kind == "dcp":
            chunks = self._dcp_chunks(key, DTYPES[entry["dtype"]])
        else:
            chunks = self._shard_chunks(name, key)
        total = numel(entry["shape"])
        if not tiles(total, [(start, start + length) for start, length, _ in chunks]):
            spans = [(start, start + length) for start, length, _ in chunks][:8]
            raise CheckpointError(f"{self.path}: the chunks of {key!r} {spans} do not tile its {total} items")
        return chunks

    def _shard_chunks(self, name: str, key: str) -> list[tuple[int, int, Callable[[], Any]]]:
        chunks = []
        for chunk in self.tensors[name]["chunks"]:
            file = self.path / self.description["files"][chunk["file"]]
            if file not in self._handles:
                self._handles[file] = open_safetensors(file)
            length = chunk["end"] - chunk["start"]
            piece = checked_slice(self._handles[file], file, key, self.tensors[name]["dtype"], length)
            chunks.append((chunk["start"], length, lambda piece=piece: piece[:]))
        return chunks

    def _dcp_chunks(self, key: str, dtype: torch.dtype) -> list[tuple[int, int, Callable[[], Any]]]:
        fqn = f"{self._prefix}tensors.{key}"
        stored = self._metadata.state_dict_metadata.get(fqn)
        chunks = getattr(stored, "chunks", None)
        if not isinstance(chunks, list):
            raise CheckpointError(f"{self.path} lacks {fqn}")
        found = []
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (_flat(offsets) and _flat(sizes)):
                raise CheckpointError(f"{self.path}: {fqn} has a chunk at {offsets} of {sizes}, not a flat range")
            if sizes[0]:
                limit = sizes[0] * dtype.itemsize + 2**16  # the tensor's bytes and torch.save's framing
                self._dcp_location(fqn, offsets, limit)
                found.append((offsets[0], sizes[0], lambda at=offsets, limit=limit: self._dcp_item(fqn, at, limit)))
        return found


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _flat(value: Any) -> bool:
    """A one-dimensional offset or size, as DCP stores them for the averager's flattened tensors."""
    return isinstance(value, (tuple, list)) and len(value) == 1 and is_count(value[0])
