"""A model folder's weight files (safetensors in the Hugging Face layout), written by one process
or by many at once.

The plan is the same wherever it is made: the entries (one per tensor name, in order) are split
into files of at most ``max_shard_size`` (one ``model.safetensors``, or
``model-ID-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``), and every entry's
byte offset in its file follows from the headers alone. Every export has an id of its own (random,
agreed by its writers), written into every file's metadata and the index's, and into the names of
a split model's files: so a reader that reads the index first, as Transformers does, gets the files
of the export the index belongs to, or (once a later export removed them) none, never a mix; and
``check_one_export`` lets a reader refuse a mix of files that carry different ids.

One process (the committer) creates every file at its final size under its temporary name
(``.NAME.incomplete``), with the index and the files that go beside the weights (provenance), so
that everything in the way of a name it writes is found before anything is committed; any process
writes any entry's bytes at their offset (``Slots``), after reading back the header, and so this
export's id, through the descriptor it writes with (a folder that is not the same on every writer,
a node-local disk holding an earlier export's leftover, is refused rather than written with
zeros); and the committer, once every writer has finished, moves the files into place, the index
after the weights, and only then removes the previous export's weight files. Until then the
folder holds the previous export whole, or none; temporary files a killed write left are replaced
or removed by the next one. Other files in the folder (a ``config.json``, a tokenizer) are never
touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base.dist import rank
from ..base.errors import CheckpointError, ExportError
from ..checkpoints.format import WEIGHTS_FILE, WEIGHTS_INDEX
from ..checkpoints.storage import (
    Entry,
    commit_file,
    discard_staged,
    fsync_dir,
    open_exclusive,
    safetensors_header,
    staging_path,
)
from .record import EXPORT_ID, OWNER, FolderRecord

EXPORT_ID_FORM = re.compile(r"^[0-9a-f]{12}$")  # fixed length: the headers' sizes do not depend on it
UNNAMED = "0" * 12  # the id of a plan not yet given its export's (sizes and offsets are the same)


def plan_files(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Split entries, in order, into files of at most ``max_bytes`` (a larger tensor gets a file alone)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


@dataclass(frozen=True)
class Slot:
    """Where one entry's bytes go: file ``file`` of the plan, from byte ``offset``."""

    file: int
    offset: int
    entry: Entry


class WeightPlan:
    """The weight files of one export: their names, headers and sizes, and each entry's slot.

    The ``record`` of how the folder is made goes into every file's metadata and the index's
    (its provenance, beside them: ``beside``). ``export_id`` (12 hex digits) goes there too and
    into the names of a split model's files; its length is fixed, so the slots and sizes are the
    same whatever the id (``with_id`` gives the same plan under the export's own)."""

    def __init__(self, entries: list[Entry], max_bytes: int, record: FolderRecord, export_id: str = UNNAMED) -> None:
        if not EXPORT_ID_FORM.match(export_id):
            raise ValueError(f"an export id is 12 hex digits, got {export_id!r}")
        self.entries, self.max_bytes, self.record, self.export_id = entries, max_bytes, record, export_id
        metadata = record.to_metadata()
        files = plan_files(entries, max_bytes)
        self.names = (
            [WEIGHTS_FILE]
            if len(files) == 1
            else [f"model-{export_id}-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
        )
        identified = metadata | {EXPORT_ID: export_id}
        self.headers = [safetensors_header(planned, identified) for planned in files]
        self.sizes = []
        self.slots: list[Slot] = []
        for number, (planned, header) in enumerate(zip(files, self.headers)):
            offset = len(header)
            for entry in planned:
                self.slots.append(Slot(number, offset, entry))
                offset += entry.nbytes
            self.sizes.append(offset)
        self.index = None
        if len(files) > 1:
            self.index = {
                "metadata": {
                    "total_size": sum(e.nbytes for e in entries),
                    OWNER: metadata[OWNER],
                    EXPORT_ID: export_id,
                },
                "weight_map": {slot.entry.key: self.names[slot.file] for slot in self.slots},
            }

    def with_id(self, export_id: str) -> WeightPlan:
        """The same plan (slots, sizes) as the export ``export_id``'s."""
        return WeightPlan(self.entries, self.max_bytes, self.record, export_id)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def beside(self) -> dict[str, bytes]:
        """The files committed after the weights, in order: the index (of a split model), then the
        record's provenance (``provenance.json``)."""
        index = {} if self.index is None else {WEIGHTS_INDEX: json.dumps(self.index, indent=1).encode()}
        return index | self.record.provenance_file()


def create_staged(directory: Path, plan: WeightPlan) -> None:
    """The committer's first step: every file under its temporary name, synced: the weight files
    with their header written and their size final (the tensors' bytes are written into them by
    ``Slots``), the index and the provenance (``plan.beside``). So
    whatever is in the way of a name written is refused before anything is committed."""
    try:
        for name, header, size in zip(plan.names, plan.headers, plan.sizes):
            with open_exclusive(staging_path(directory / name)) as handle:
                handle.write(header)
                handle.truncate(size)
                handle.flush()
                os.fsync(handle.fileno())
        for name, data in plan.beside.items():
            with open_exclusive(staging_path(directory / name)) as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException:
        discard(directory, plan)
        raise


class Slots:
    """A writer's handles on the temporary files: ``write(slot, tensor)`` puts a tensor's bytes at
    its slot; ``close()`` syncs every file it wrote. The files must exist (``create_staged``):
    a writer that cannot see them is on a file system the committer's files are not on."""

    def __init__(self, directory: Path, plan: WeightPlan) -> None:
        self.directory, self.plan = directory, plan
        self._fds: dict[int, int] = {}

    def write(self, slot: Slot, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Write ``tensor`` at the slot: the entry's whole tensor, or its rows ``[start, stop)``."""
        entry = slot.entry
        start, stop = rows if rows is not None else (0, 0)
        expected = entry.shape if rows is None else (stop - start, *entry.shape[1:])
        outside = rows is not None and not (entry.shape and 0 <= start < stop <= entry.shape[0])
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != expected or outside:
            got = f"{tensor.dtype} {tuple(tensor.shape)}" + (f" as rows {start}..{stop}" if rows else "")
            raise ValueError(f"{entry.key!r}: got {got}, planned {entry.dtype} {entry.shape}")
        self.write_elements(slot, tensor.reshape(-1), start * math.prod(entry.shape[1:]))

    def write_elements(self, slot: Slot, flat: torch.Tensor, first: int) -> None:
        """Write ``flat`` as elements ``[first, first + flat.numel())`` of the entry's tensor, flattened."""
        entry = slot.entry
        if (
            flat.dtype != entry.dtype
            or flat.dim() != 1
            or not 0 <= first <= first + flat.numel() <= math.prod(entry.shape)
        ):
            got = f"{flat.dtype} {tuple(flat.shape)} from element {first}"
            raise ValueError(f"{entry.key!r}: got {got}, planned {entry.dtype} {entry.shape}")
        flat = flat.detach().to("cpu").contiguous()
        if not flat.numel():
            return
        data = memoryview((ctypes.c_ubyte * flat.nbytes).from_address(flat.data_ptr()))  # no copy
        fd, offset = self._fd(slot.file), slot.offset + first * flat.element_size()
        while data:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written

    def _fd(self, number: int) -> int:
        """The descriptor this writer writes file ``number`` with, proved to be the file the
        committer created for this export: its header (which holds the export's id) read back
        through it. A folder that is not the same on every writer (a node-local disk at the same
        path on every node) holds no such file, or an earlier export's leftover: refused, where
        writing into it would leave the committer's file with zeros in this writer's place."""
        if number not in self._fds:
            path = staging_path(self.directory / self.plan.names[number])
            unshared = (
                f"rank {rank()} does not share {self.directory} with the committer (rank 0): each sees its own "
                "folder at that path (a node-local disk?); export into a folder on a file system every rank "
                "sees, or with writers=1"
            )
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise ExportError(f"{path} is not there to write into: {unshared}") from None
            self._fds[number] = fd  # (closed by close(), also when refused below)
            header = self.plan.headers[number]
            if os.pread(fd, len(header), 0) != header:
                raise ExportError(f"{path} is not this export's file (another export's leftover): {unshared}")
        return self._fds[number]

    def close(self) -> None:
        """Sync and close every file written (also after a failure: the committer discards them)."""
        fds, self._fds = self._fds, {}
        try:
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)


def commit(directory: Path, plan: WeightPlan, previous: dict[str, bool]) -> None:
    """The committer's last step, renames only (everything was staged by ``create_staged``):
    every weight file into place, then the index (the switch of a split model: its files have
    names of their own, so a reader of the previous index still finds the previous files), then
    the provenance; only then the previous export's other weight files are removed."""
    written = [*plan.names, *plan.beside]
    for name in written:
        commit_file(directory / name)
    for stale in set(previous) - set(written):
        (directory / stale).unlink(missing_ok=True)
    fsync_dir(directory)


def discard(directory: Path, plan: WeightPlan) -> None:
    """Remove the temporary files of a write that did not finish."""
    for name in [*plan.names, *plan.beside]:
        with contextlib.suppress(OSError):
            discard_staged(directory / name)


def check_one_export(files: Iterable[tuple[str, Mapping[str, Any] | None]]) -> str | None:
    """Refuse weights read from two exports; return their export id (None: none carries one).

    A reader of a folder being re-exported could otherwise load some tensors of one export and
    some of the next. ``files``: where and what metadata, the index's ``"metadata"`` (of a split
    model) first, then every weight file's ``__metadata__`` as the reader opened it (checking the
    files it holds open, not the names again). Files of an export older than export ids carry
    none, and are taken as they are.

    Raises:
        CheckpointError: The files carry different export ids (or some carry one, others none).
    """
    first: tuple[str, Any] | None = None
    for where, metadata in files:
        found = metadata.get(EXPORT_ID) if isinstance(metadata, Mapping) else None
        if first is None:
            first = (where, found)
        elif found != first[1]:
            raise CheckpointError(
                f"{where} holds {_export(found)}, {first[0]} {_export(first[1])}: files of two exports (the "
                "folder was re-exported while it was read); read it again once the export has finished"
            )
    return None if first is None else first[1]


def _export(export_id: Any) -> str:
    return "no export id" if export_id is None else f"export {export_id}"
