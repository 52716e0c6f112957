"""Reading an averager checkpoint in one process, without a process group, tensor by tensor.

Two layouts are understood: ``avg.save``'s (a ``shardavg.json`` manifest and one safetensors
file per rank) and the entry an averager wrote into a ``torch.distributed.checkpoint``
directory. DCP stores its ``.metadata`` as a pickle; it is read with an unpickler that only
builds DCP's own metadata classes, and tensors with ``torch.load(weights_only=True)``, so a
checkpoint carrying a malicious pickle is refused before anything in it runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from .checkpoint import MANIFEST, STEP_DIR, read_manifest, resolve
from .errors import CheckpointError
from .stateful import decode_description
from .storage import DTYPES, open_safetensors

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
    """An averager's checkpoint opened for reading: ``description`` and ``read(name)``."""

    def __init__(self, path: str | Path, key: str = "ema") -> None:
        path = Path(path)
        if (path / ".metadata").is_file():
            self._open_dcp(path, key)
        elif path.is_dir() and ((path / MANIFEST).is_file() or any(STEP_DIR.match(p.name) for p in path.iterdir())):
            self.path = resolve(path)
            self.description = read_manifest(self.path)
            self.kind = "shardavg"
        else:
            raise CheckpointError(
                f"{path} is neither a shardavg checkpoint ({MANIFEST}) nor a DCP checkpoint (.metadata)"
            )
        self.tensors = {entry["name"]: entry for entry in self.description["tensors"]}

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
        if not isinstance(entries, dict) or f"{key}.meta" not in entries:
            found = sorted({name.split(".")[0] for name in entries or {}})
            raise CheckpointError(f"{path} has no averager under key {key!r} (top-level keys: {found})")
        self.description = decode_description(self._dcp_item(f"{key}.meta", None), f"{path} [{key}]")

    def _dcp_item(self, fqn: str, offset: torch.Size | None) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._metadata.storage_data.get(MetadataIndex(fqn, offset))
        if info is None:
            raise CheckpointError(f"{self.path}: no stored data for {fqn} at {offset}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{self.path}: {fqn} is stored with transforms {info.transform_descriptors}, unsupported"
            )
        file = self.path / info.relative_path
        try:
            with open(file, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            if len(data) != info.length:
                raise CheckpointError(
                    f"{file} is truncated: {fqn} needs bytes {info.offset}..{info.offset + info.length}"
                )
            return torch.load(io.BytesIO(data), weights_only=True)
        except CheckpointError:
            raise
        except Exception as error:  # torch.load refuses anything but tensors and plain containers
            raise CheckpointError(f"cannot read {fqn} from {file}: {error}") from error

    # --------------------------------------------------------------- reading

    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` in its original shape (one tensor in memory at a time)."""
        entry = self.tensors[name]
        dtype = DTYPES[entry["dtype"]]
        shape = torch.Size(entry["shape"])
        flat = torch.empty(shape.numel(), dtype=dtype)
        if self.kind == "dcp":
            fqn = f"{self._prefix}tensors.{name}"
            stored = self._metadata.state_dict_metadata.get(fqn)
            if stored is None:
                raise CheckpointError(f"{self.path} lacks {fqn}")
            for chunk in stored.chunks:
                if chunk.sizes.numel():
                    start = chunk.offsets[0]
                    flat[start : start + chunk.sizes[0]] = self._dcp_item(fqn, chunk.offsets)
        else:
            for chunk in entry["chunks"]:
                file = self.path / self.description["files"][chunk["file"]]
                with open_safetensors(file) as handle:
                    if name not in handle.keys():
                        raise CheckpointError(f"{file} lacks tensor {name!r}")
                    flat[chunk["start"] : chunk["end"]] = handle.get_tensor(name)
        return flat.view(shape)
