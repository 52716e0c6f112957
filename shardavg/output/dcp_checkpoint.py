"""A merge written as a ``torch.distributed.checkpoint`` folder, which trainers load back.

Megatron-Core (``dist_checkpointing.load``) and torchtitan (its ``CheckpointManager``, a model-only
checkpoint) resume or evaluate from a DCP folder, never from a model folder. Every writer writes the
chunks it merged into a file of its own (``__{rank}_{token}.distcp``), each chunk as DCP writes an item
(``torch.save`` of the tensor, one after another), synced and committed under its name only when
complete (``write_part``); the first writer then gathers what each wrote (plain data) and writes
``.metadata`` through DCP's own ``FileSystemWriter.finish`` (``commit``): the keys, shapes and
dtypes of the inputs, each chunk a box of its tensor, and the entries' nesting as the newest input
recorded it. What a trainer needs beside the tensors is copied byte for byte, never unpickled: the
newest input's pickled objects as DCP stored them (Megatron's ``*._extra_state``, which its load
asks for: ``write_part``'s ``objects``) and its files (Megatron's ``metadata.json`` and
``common.pt``: ``carry``).

Such a folder is shardavg's when its ``provenance.json`` says a merge wrote it as DCP, and it holds
nothing but the files a merge writes there (``check_replaceable``). A merge never writes into it:
``staged`` holds it (locked beside it, as a checkpoint swapped whole is) and makes a staging folder
beside it (``.OUT.incomplete``: a marker with this merge's token, which every writer checks it sees
before writing there, ``joined``; then the record); every part, the carried files and ``.metadata``
go there, and ``swap`` moves it into place in one exchange once ``.metadata`` is written. Until
then OUT is the earlier merge, whole, or nothing; a merge that fails removes its staging folder,
and one a killed merge left is recognised by its marker (``is_own_staging``) and removed by the next.

A merge (``offline/merge.py``) calls these in this sequence; a failure at a step is every
writer's there (``Writers.agree``):

0) (the merge, before: one process) ``check_replaceable``: OUT is nothing, or a DCP folder an
   earlier merge wrote.
1) (first writer) ``staged``: the lock beside OUT, the staging folder with this merge's token in
   its marker; with a Megatron-Core input, what its newest input carries (objects and files).
2) (every writer) receive the token; ``joined``: the staging folder, checked to be this merge's;
   ``write_part``: its merged chunks (and the first writer the carried objects) into its own file.
3) (every writer) send what it wrote (``Written``, plain data) to the first writer.
4) (first writer) ``carry`` the input's files; ``commit``: ``.metadata`` through DCP's own
   ``FileSystemWriter.finish``, checked to cover every tensor; ``swap``: the staging folder into
   place as OUT. (every writer) agree on the commit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..base.errors import CheckpointError, ProvenanceError
from ..checkpoints.format import DCP_METADATA
from ..checkpoints.ownership import LOCK_FILE, STAGING_MARKER, TargetLock, entries_of, target_path, temporary_of
from ..checkpoints.storage import (
    atomic_file,
    commit_folder,
    open_regular,
    read_bounded,
    replaced_path,
    staging_path,
)
from .provenance import FILE as PROVENANCE
from .provenance import load as load_provenance

Rows = tuple[int, int] | None  # rows [start, stop) of a tensor; None: all of it
COPY_BYTES = 2**20  # bytes an object or a carried file is copied by: none is ever held whole
FORMAT = "dcp"  # what a merge's provenance says it wrote (``"output"``), making the folder shardavg's
# what a merge writes into its DCP folder: the metadata (DCP's temporary name too), the parts, the
# files carried from a Megatron input, the record
OWN_FILE = re.compile(r"^(\.metadata(\.tmp)?|__\d+_[0-9a-f]+\.distcp|metadata\.json|common\.pt|provenance\.json)$")


@dataclass(frozen=True)
class StoredBytes:
    """Where an input's item lies: ``length`` bytes of the regular ``file`` from ``start``, checked by
    its reader (``DcpFolder.location``); copied from there a piece at a time (``write_part``)."""

    file: Path
    start: int
    length: int


@dataclass(frozen=True)
class Written:
    """One chunk a writer wrote: its tensor's key, its box, and where its bytes lie (plain data,
    gathered to the first writer)."""

    key: str
    offsets: tuple[int, ...] | None  # (None: an object's bytes, copied as they were)
    sizes: tuple[int, ...] | None
    file: str
    start: int
    length: int


def part_name(rank: int, merge: str = "0") -> str:
    """The file writer ``rank`` writes its chunks into: DCP's naming, with the ``merge``'s token
    in place of DCP's file index, so that a reader that took an earlier merge's ``.metadata``
    finds its files gone after a re-merge rather than the new merge's bytes at the old offsets."""
    return f"__{rank}_{merge}.distcp"


def write_part(
    folder: Path,
    rank: int,
    chunks: Iterable[tuple[str, Rows, torch.Tensor]],
    objects: Iterable[tuple[str, StoredBytes]] = (),
    merge: str = "0",
) -> list[Written]:
    """Write this writer's ``chunks`` (``(key, rows or None, tensor)``: a whole tensor, or its rows
    ``[start, stop)``) into its file of ``folder``, one after another as DCP stores items, then
    ``objects`` (``(key, where its bytes lie)``: an input's pickled object, such as Megatron's
    ``*._extra_state``, copied as it was stored, ``COPY_BYTES`` at a time: never unpickled, nor
    held whole, so memory does not grow with the objects' number or size); the file appears,
    complete and synced, only when all are written, named by ``part_name(rank, merge)``.
    Returns where each lies."""
    name, written, start = part_name(rank, merge), [], 0
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
        for key, stored in objects:
            _copy_stored(stored, handle)
            written.append(Written(key, None, None, name, start, stored.length))
            start += stored.length
    return written


def _copy_stored(stored: StoredBytes, target: BinaryIO) -> None:
    """Copy ``stored``'s bytes into ``target`` ``COPY_BYTES`` at a time (never through a link; a
    file cut short meanwhile is refused by name)."""
    with os.fdopen(open_regular(stored.file), "rb") as source:
        source.seek(stored.start)
        left = stored.length
        while left:
            piece = source.read(min(left, COPY_BYTES))
            if not piece:
                raise CheckpointError(f"{stored.file} ended before byte {stored.start + stored.length}: truncated?")
            target.write(piece)
            left -= len(piece)


def commit(
    folder: Path,
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    written: list[Written],
    nesting: dict[str, tuple] | None = None,
    named: Path | None = None,
) -> None:
    """Write ``folder``'s ``.metadata`` (the first writer, once every writer's part is written):
    ``tensors`` (``{key: (dtype, shape)}``) and the chunks every writer ``written``, checked to
    cover each tensor; ``nesting`` (``{key: path}``), how the state dict saved nested each entry
    (DCP's ``planner_data``; default: every key at the top level); ``named``, the path the
    checkpoint is read at (recorded as DCP's ``checkpoint_id``; default ``folder``): OUT, where
    ``folder`` is its staging folder."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
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
            raise CheckpointError(f"{folder}: a writer wrote {chunk.key!r}, which the merge does not hold")
        entries[chunk.key].chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
        index = MetadataIndex(chunk.key, chunk.offsets)
        results.append(WriteResult(index, chunk.length, _StorageInfo(chunk.file, chunk.start, chunk.length)))
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        held = sum(chunk.sizes.numel() for chunk in entry.chunks)
        if held != entry.size.numel():
            raise CheckpointError(f"{folder}: the writers wrote {held} of {key!r}'s {entry.size.numel()} elements")
    planner = {key: tuple((nesting or {}).get(key, (key,))) for key in entries}
    writer = FileSystemWriter(folder)
    recorded = StorageMeta(checkpoint_id=named or folder, save_id=writer.save_id)
    writer.storage_meta = lambda: recorded  # (finish records the writer's own path: the staging folder's)
    writer.finish(Metadata(entries, planner_data=planner), [results])


def carry(folder: Path, files: Iterable[Path]) -> None:
    """Copy ``files`` (a trainer's own beside its DCP items: Megatron's ``metadata.json``,
    ``common.pt``, each ``confined`` to its input by its reader) into ``folder`` byte for byte,
    ``COPY_BYTES`` at a time, each appearing complete; nothing in them is parsed, and each must be
    a regular file (a pipe would block the copy)."""
    for file in files:
        if file.name == DCP_METADATA or file.suffix == ".distcp":
            raise CheckpointError(f"{file} is the checkpoint's own DCP data: it is written, never carried")
        with os.fdopen(open_regular(file, follow_links=True), "rb") as source:
            with atomic_file(folder / file.name) as target:
                shutil.copyfileobj(source, target, COPY_BYTES)


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
    if not _written_as_dcp(record):
        what = "a DCP checkpoint" if DCP_METADATA in entries else "files"
        raise CheckpointError(
            f"OUT {folder} holds {what} shardavg's merge did not write (no {PROVENANCE} of a merge written as "
            f"{FORMAT}): name a new or empty folder"
        )
    foreign = _foreign(entries)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f", ... {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise CheckpointError(f"OUT {folder} holds files a merge did not write ({shown}): name a new or empty folder")


def _written_as_dcp(record: Any) -> bool:
    """Whether a ``provenance.json`` record is a merge's written as DCP."""
    return isinstance(record, dict) and record.get("made") == "merge" and record.get("output") == FORMAT


def _foreign(entries: dict[str, Any]) -> list[str]:
    """The entries (``{name: stat}``) that are not a regular file a merge writes into its folder."""
    return sorted(
        name
        for name, st in entries.items()
        if not stat.S_ISREG(st.st_mode) or not (OWN_FILE.match(name) or temporary_of(name, OWN_FILE))
    )


def is_own_staging(folder: Path) -> bool:
    """Whether ``folder`` (``.OUT.incomplete``) is what a killed merge left: a real folder of
    nothing but the files a merge writes, marked as its staging folder (before the swap), or an
    earlier merge (swapped out by it), or empty."""
    entries = entries_of(folder)
    if entries is None:
        return False
    rest = {name: st for name, st in entries.items() if name not in (STAGING_MARKER, LOCK_FILE)}
    marked = STAGING_MARKER in entries and stat.S_ISREG(entries[STAGING_MARKER].st_mode)
    if _foreign(rest) or (STAGING_MARKER in entries and not marked):
        return False
    if marked or not rest:
        return True
    try:
        return _written_as_dcp(load_provenance(folder / PROVENANCE))
    except ProvenanceError:
        return False


@contextlib.contextmanager
def staged(out: Path, made: dict[str, Any]) -> Iterator[str]:
    """Hold ``out`` for one merge written as DCP (the first writer, from before any part is written
    to the swap): locked beside it (it is replaced whole), checked again (``check_replaceable``),
    what a killed merge left beside it removed, and its staging folder made: the marker, holding a
    new token (yielded: every writer proves it sees this folder by it, ``joined``), then the record
    ``made`` (with ``"output": "dcp"``). When the block raises, the staging folder goes and ``out``
    is as it was: the earlier merge, or nothing (not even an empty folder)."""
    out = target_path(out, "merge", replaced_whole=True)
    with TargetLock.beside(out):
        check_replaceable(out)
        staging = staging_path(out)
        for leftover in (staging, replaced_path(out)):
            if not (leftover.exists() or leftover.is_symlink()):
                continue
            if not is_own_staging(leftover):
                raise CheckpointError(
                    f"{leftover} is in the way of the merge into {out} and is not shardavg's: move it"
                )
            if leftover == staging or out.exists():  # (a .replaced without OUT is the earlier merge: kept)
                shutil.rmtree(leftover)
        staging.mkdir(parents=True)
        try:
            token = secrets.token_hex(16)
            (staging / STAGING_MARKER).write_text(token)  # (in a folder just made: its name alone marks it)
            with atomic_file(staging / PROVENANCE) as handle:
                handle.write(json.dumps(made | {"output": FORMAT}, indent=1).encode())
            yield token
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def joined(out: Path, token: str, rank: int) -> Path:
    """The staging folder of ``out`` that writer ``rank`` writes its part into, proved to be the
    one the first writer made for this merge (its marker holds ``token``): a folder that is not
    the same on every writer (a node-local disk at the same path) is refused before anything is
    written, where its part would be missing from the checkpoint."""
    staging = staging_path(out)
    unshared = (
        f"rank {rank} does not share {out} with the first writer (rank 0): each sees its own folder at that "
        "path (a node-local disk?); merge into a folder on a file system every writer sees"
    )
    try:
        found = read_bounded(staging / STAGING_MARKER, 64, lambda size: CheckpointError(f"{staging}: {unshared}"))
    except FileNotFoundError:
        raise CheckpointError(f"{staging} is not there to write into: {unshared}") from None
    if found != token.encode():
        raise CheckpointError(f"{staging} is another merge's staging folder: {unshared}")
    return staging


def swap(out: Path) -> None:
    """Move ``out``'s staging folder, complete (``.metadata`` committed into it), into place (the
    first writer, within ``staged``): its marker removed, ``out`` checked once more to be
    replaceable (a folder someone wrote into meanwhile is left alone), then exchanged with it in
    one step (``storage.commit_folder``); the earlier merge is removed after."""
    staging = staging_path(out)
    (staging / STAGING_MARKER).unlink()
    check_replaceable(out)
    commit_folder(staging, out)
    replaced = replaced_path(out)
    if replaced.exists() and is_own_staging(replaced):  # (the earlier merge, kept by a swap killed long ago)
        shutil.rmtree(replaced)
