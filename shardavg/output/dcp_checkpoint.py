"""A merge written as a ``torch.distributed.checkpoint`` folder, which trainers load back.

Megatron-Core (``dist_checkpointing.load``) and torchtitan (its ``CheckpointManager``, a model-only
checkpoint) resume or evaluate from a DCP folder, never from a model folder. Every worker writes the
chunks it merged into a file of its own (``__{rank}_0.distcp``), each chunk as DCP writes an item
(``torch.save`` of the tensor, one after another), synced and committed under its name only when
complete (``write_part``); the first worker then gathers what each wrote (plain data) and writes
``.metadata`` through DCP's own ``FileSystemWriter.finish`` (``commit``): the keys, shapes and
dtypes of the inputs, each chunk a box of its tensor, and the entries' nesting as the newest input
recorded it. What a trainer needs beside the tensors is copied byte for byte, never unpickled: the
newest input's pickled objects as DCP stored them (Megatron's ``*._extra_state``, which its load
asks for: ``write_part``'s ``objects``) and its files (Megatron's ``metadata.json`` and
``common.pt``: ``carry``).

Such a folder is shardavg's when its ``provenance.json`` says a merge wrote it as DCP, and it holds
nothing but the files a merge writes there (``check_replaceable``); ``taken`` holds it for one
write: locked, its previous ``.metadata`` removed first (so a merge that fails leaves no folder
that looks complete: ``.metadata`` is written last, by ``commit``), its record written first.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CheckpointError, ProvenanceError
from ..checkpoints.format import DCP_METADATA
from ..checkpoints.ownership import LOCK_FILE, TargetLock, entries_of, temporary_of
from ..checkpoints.storage import atomic_file
from .provenance import FILE as PROVENANCE
from .provenance import load as load_provenance

Rows = tuple[int, int] | None  # rows [start, stop) of a tensor; None: all of it
FORMAT = "dcp"  # what a merge's provenance says it wrote (``"output"``), making the folder shardavg's
# what a merge writes into its DCP folder: the metadata (DCP's temporary name too), the parts, the
# files carried from a Megatron input, the record
OWN_FILE = re.compile(r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp|metadata\.json|common\.pt|provenance\.json)$")


@dataclass(frozen=True)
class Written:
    """One chunk a worker wrote: its tensor's key, its box, and where its bytes lie (plain data,
    gathered to the first worker)."""

    key: str
    offsets: tuple[int, ...] | None  # (None: an object's bytes, copied as they were)
    sizes: tuple[int, ...] | None
    file: str
    start: int
    length: int


def part_name(rank: int) -> str:
    """The file worker ``rank`` writes its chunks into (DCP's own naming)."""
    return f"__{rank}_0.distcp"


def write_part(
    folder: Path,
    rank: int,
    chunks: Iterable[tuple[str, Rows, torch.Tensor]],
    objects: Iterable[tuple[str, bytes]] = (),
) -> list[Written]:
    """Write this worker's ``chunks`` (``(key, rows or None, tensor)``: a whole tensor, or its rows
    ``[start, stop)``) into its file of ``folder``, one after another as DCP stores items, then
    ``objects`` (``(key, bytes)``: an input's pickled object, such as Megatron's ``*._extra_state``,
    copied as it was stored, never unpickled); the file appears, complete and synced, only when all
    are written. Returns where each lies."""
    name, written, start = part_name(rank), [], 0
    with atomic_file(folder / name) as handle:
        for key, rows, tensor in chunks:
            buffer = io.BytesIO()
            torch.save(tensor.contiguous(), buffer)
            data = buffer.getbuffer()
            handle.write(data)
            offsets = (rows[0] if rows else 0, *(0,) * (tensor.dim() - 1)) if tensor.dim() else ()
            written.append(Written(key, offsets, tuple(tensor.shape), name, start, len(data)))
            start += len(data)
            del tensor, data, buffer  # (before the next chunk is merged)
        for key, data in objects:
            handle.write(data)
            written.append(Written(key, None, None, name, start, len(data)))
            start += len(data)
    return written


def commit(
    folder: Path,
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    written: list[Written],
    nesting: dict[str, tuple] | None = None,
) -> None:
    """Write ``folder``'s ``.metadata`` (the first worker, once every worker's part is written):
    ``tensors`` (``{key: (dtype, shape)}``) and the chunks every worker ``written``, checked to
    cover each tensor; ``nesting`` (``{key: path}``), how the state dict saved nested each entry
    (DCP's ``planner_data``; default: every key at the top level)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    entries: dict[str, Any] = {
        key: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])
        for key, (dtype, shape) in tensors.items()
    }
    results = []
    for chunk in written:
        if chunk.offsets is None or chunk.sizes is None:  # an object's bytes
            if chunk.key in entries:
                raise CheckpointError(f"{folder}: {chunk.key!r} was written twice")
            entries[chunk.key] = BytesStorageMetadata()
            index = MetadataIndex(chunk.key)
            results.append(WriteResult(index, chunk.length, _StorageInfo(chunk.file, chunk.start, chunk.length)))
            continue
        if chunk.key not in entries or not isinstance(entries[chunk.key], TensorStorageMetadata):
            raise CheckpointError(f"{folder}: a worker wrote {chunk.key!r}, which the merge does not hold")
        entries[chunk.key].chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
        index = MetadataIndex(chunk.key, chunk.offsets)
        results.append(WriteResult(index, chunk.length, _StorageInfo(chunk.file, chunk.start, chunk.length)))
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        held = sum(chunk.sizes.numel() for chunk in entry.chunks)
        if held != entry.size.numel():
            raise CheckpointError(f"{folder}: the workers wrote {held} of {key!r}'s {entry.size.numel()} elements")
    planner = {key: tuple((nesting or {}).get(key, (key,))) for key in entries}
    FileSystemWriter(folder).finish(Metadata(entries, planner_data=planner), [results])


def carry(folder: Path, files: Iterable[Path]) -> None:
    """Copy ``files`` (a trainer's own beside its DCP items: Megatron's ``metadata.json``,
    ``common.pt``) into ``folder`` byte for byte, each appearing complete; nothing in them is read."""
    for file in files:
        if file.name == DCP_METADATA or file.suffix == ".distcp":
            raise CheckpointError(f"{file} is the checkpoint's own DCP data: it is written, never carried")
        with open(file, "rb") as source, atomic_file(folder / file.name) as target:
            shutil.copyfileobj(source, target, 2**24)


def nesting_of(metadata: Any) -> dict[str, tuple]:
    """``{key: path}`` an input's DCP metadata records (its ``planner_data``), for ``commit``."""
    recorded = getattr(metadata, "planner_data", None)
    return {str(k): tuple(v) for k, v in recorded.items() if isinstance(v, tuple)} if isinstance(recorded, dict) else {}


def check_replaceable(folder: Path) -> None:
    """Refuse ``folder`` as a merge's DCP output unless it is new, empty, or shardavg's: a
    ``provenance.json`` saying a merge wrote it as DCP, and nothing but the regular files a merge
    writes there (an earlier merge's, replaced; or the leftovers of one that failed)."""
    entries = {name: st for name, st in (entries_of(folder) or {}).items() if name != LOCK_FILE}
    if not entries:
        return
    try:
        record = load_provenance(folder / PROVENANCE) if PROVENANCE in entries else None
    except ProvenanceError as error:
        raise CheckpointError(f"OUT {folder} is no merge of shardavg's ({error}): name a new or empty folder") from None
    if not isinstance(record, dict) or record.get("made") != "merge" or record.get("output") != FORMAT:
        what = "a DCP checkpoint" if DCP_METADATA in entries else "files"
        raise CheckpointError(
            f"OUT {folder} holds {what} shardavg's merge did not write (no {PROVENANCE} of a merge written as "
            f"{FORMAT}): name a new or empty folder"
        )
    foreign = sorted(
        name
        for name, st in entries.items()
        if not stat.S_ISREG(st.st_mode) or not (OWN_FILE.match(name) or temporary_of(name, OWN_FILE))
    )
    if foreign:
        shown = ", ".join(foreign[:8]) + (f", ... {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise CheckpointError(f"OUT {folder} holds files a merge did not write ({shown}): name a new or empty folder")


@contextlib.contextmanager
def taken(folder: Path, made: dict[str, Any]) -> Iterator[None]:
    """Hold ``folder`` for one merge written as DCP (the first worker, while every worker writes):
    made if new, locked, checked again (``check_replaceable``), emptied of an earlier merge's
    files, ``.metadata`` first (from then on it is no checkpoint until ``commit``), and its record
    ``made`` (with ``"output": "dcp"``) written before any part, so that even a merge that fails
    leaves a folder shardavg can tell is its own."""
    folder.mkdir(parents=True, exist_ok=True)
    with TargetLock.inside(folder):
        check_replaceable(folder)
        (folder / DCP_METADATA).unlink(missing_ok=True)
        for name in sorted(entries_of(folder) or {}):
            if name not in (LOCK_FILE, PROVENANCE):  # (replaced below: the folder stays provably ours)
                (folder / name).unlink()
        with atomic_file(folder / PROVENANCE) as handle:
            handle.write(json.dumps(made | {"output": FORMAT}, indent=1).encode())
        yield
