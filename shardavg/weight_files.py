"""A model folder's weight files (safetensors in the Hugging Face layout), written by one process
or by many at once.

The plan is the same wherever it is made: the entries (one per tensor name, in order) are split
into files of at most ``max_shard_size`` (one ``model.safetensors``, or
``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``), and every entry's
byte offset in its file follows from the headers alone. So one process (the committer) creates
every file at its final size under its temporary name (``.NAME.incomplete``), any process
writes any entry's bytes at their offset (``Slots``), and the committer, once every writer has
finished, moves the files into place, the index last, and removes the previous export's other
weight files. Until then the folder holds the previous export whole, or none; temporary files a
killed write left are replaced by the next one. Other files in the folder (a ``config.json``, a
tokenizer) are never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, ExportError
from .format import DCP_METADATA, MANIFEST, WEIGHTS_FILE, WEIGHTS_INDEX
from .ownership import enclosing_checkpoint, export_files
from .provenance import check_replaceable
from .storage import (
    Entry,
    atomic_file,
    commit_file,
    discard_staged,
    fsync_dir,
    open_exclusive,
    safetensors_header,
    staging_path,
)


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
    """The weight files of one export: their names, headers and sizes, and each entry's slot."""

    def __init__(self, entries: list[Entry], max_bytes: int, metadata: dict[str, str]) -> None:
        files = plan_files(entries, max_bytes)
        self.names = (
            [WEIGHTS_FILE]
            if len(files) == 1
            else [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
        )
        self.headers = [safetensors_header(planned, metadata) for planned in files]
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
                "metadata": {"total_size": sum(e.nbytes for e in entries), "shardavg": metadata["shardavg"]},
                "weight_map": {slot.entry.key: self.names[slot.file] for slot in self.slots},
            }

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def assign(items_bytes: list[int], writers: int) -> list[int]:
    """Each item's writer (0 .. writers-1), for items written in order: consecutive runs of about
    the same bytes (an item is never split)."""
    total = max(1, sum(items_bytes))
    owner, start = [], 0
    for size in items_bytes:
        owner.append(min(writers - 1, (start + size // 2) * writers // total))
        start += size
    return owner


def row_pieces(shape: tuple[int, ...], nbytes: int, largest: int) -> list[tuple[int, int] | None]:
    """A tensor of ``shape`` and ``nbytes`` as the work it is split into: ``[None]`` (whole) when it
    holds at most ``largest`` bytes (or has fewer than two rows), else ranges of consecutive rows
    of at most ``largest`` bytes each (one row at least)."""
    if nbytes <= largest or not shape or shape[0] < 2:
        return [None]
    step = max(1, largest // max(1, nbytes // shape[0]))
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def check_output_folder(
    out: str | os.PathLike, inputs: Sequence[Path] = (), *, replaces_checkpoint: bool = False, beside: bool = False
) -> Path:
    """OUT of an offline export, post-hoc synthesis or merge, checked before any work is done: a
    folder named (an empty argument would mean the current directory), outside every checkpoint
    and snapshot (and no checkpoint itself, unless the output ``replaces_checkpoint``), apart
    from every input: not one, not inside one, and (unless it may go ``beside`` them, as an
    export that writes only its own files does) not holding one. The writer checks it again
    when it takes the folder (``check_target``)."""
    if not os.fspath(out):
        raise ValueError("OUT is empty: name the folder to write into (use . for the current directory)")
    path = Path(out)
    enclosing = enclosing_checkpoint(path.parent)
    if enclosing is not None:
        raise CheckpointError(f"OUT {out} is inside the checkpoint {enclosing}: write to a folder of its own")
    if not replaces_checkpoint and enclosing_checkpoint(path) is not None:
        raise CheckpointError(f"OUT {out} is a checkpoint: name a model folder of its own")
    target = path.resolve()
    for given in inputs:
        source = given.resolve()
        if target == source or source in target.parents or (target in source.parents and not beside):
            raise CheckpointError(f"OUT {out} and the input {given} lie one inside the other: write to a folder apart")
    return path


def check_target(directory: Path) -> dict[str, bool]:
    """Refuse a target that is a file, a checkpoint or inside one, or holds weight files shardavg
    did not write; return the weight files it holds, each with whether it is shardavg's own."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ExportError(f"{directory} exists and is not a directory: shardavg will not replace it")
    if (directory / MANIFEST).exists() or (directory / DCP_METADATA).exists():
        raise ExportError(f"{directory} is a checkpoint: export into a model folder of its own")
    enclosing = enclosing_checkpoint(directory)
    if enclosing is not None:
        raise ExportError(
            f"{directory} is inside the checkpoint {enclosing}, which holds only its own files: export into a "
            "model folder of its own"
        )
    check_replaceable(directory)
    present = export_files(directory)
    foreign = sorted(name for name, own in present.items() if not own)
    if foreign:
        raise ExportError(
            f"{directory} holds weight files shardavg did not write ({', '.join(foreign)}): they would be "
            "replaced; export into another directory, or move them"
        )
    return present


def create_staged(directory: Path, plan: WeightPlan) -> None:
    """The committer's first step: every file under its temporary name, its header written and its
    size final (the tensors' bytes are written into it by ``Slots``), synced."""
    try:
        for name, header, size in zip(plan.names, plan.headers, plan.sizes):
            with open_exclusive(staging_path(directory / name)) as handle:
                handle.write(header)
                handle.truncate(size)
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
        if number not in self._fds:
            path = staging_path(self.directory / self.plan.names[number])
            try:
                self._fds[number] = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise ExportError(
                    f"{path} is not there for this process to write into: the export folder must be one every "
                    "writer sees (a shared file system); export with writers=1 otherwise"
                ) from None
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
    """The committer's last step: every file into place, the index last (the switch of a split
    model), then the previous export's other weight files removed."""
    for name in plan.names:
        commit_file(directory / name)
    if plan.index is not None:
        with atomic_file(directory / WEIGHTS_INDEX) as handle:
            handle.write(json.dumps(plan.index, indent=1).encode())
    for stale in set(previous) - set(plan.names) - ({WEIGHTS_INDEX} if plan.index is not None else set()):
        (directory / stale).unlink(missing_ok=True)
    fsync_dir(directory)


def discard(directory: Path, plan: WeightPlan) -> None:
    """Remove the temporary files of a write that did not finish."""
    for name in plan.names:
        with contextlib.suppress(OSError):
            discard_staged(directory / name)
