"""Writing a model folder: the one driver every writer goes through (``write_spread``).

The files are planned once, the same on every writer (``weight_files.WeightPlan``, which holds
the folder's ``record``). The lead writer takes the folder (``staged_export``: checked by
``target.check_out`` under its lock, the plan's files created under their temporary names); every
writer writes its share at its place in the files; once every writer has finished, the lead
commits. So the folder holds the previous export or the new one, whole, each under an export id
of its own. ``write_model`` is the one-process path (``shardavg export``, ``posthoc``): one full
tensor at a time. Floating tensors are cast to the output dtype on the way (``cast``), refused by
name where a finite value overflows it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ..base import validate
from ..base.dist import comm_device
from ..base.dtypes import dtype_name
from ..base.errors import ExportError
from ..checkpoints.description import TensorEntry
from ..checkpoints.ownership import TargetLock
from ..checkpoints.storage import Entry
from .record import FolderRecord
from .target import check_out, out_path
from .weight_files import Slots, WeightPlan, commit, create_staged, discard
from .work import Writers

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``5GB`` (10**9, as Hugging Face counts), ``500MiB`` (2**20) or a plain int."""
    if validate.is_count(size, 1) and size <= 2**62:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size)[:100], flags=re.IGNORECASE)
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()] if match else 0.0
    if not 1 <= value <= 2**62:  # also refuses an overflow to infinity
        raise ValueError(f"max_shard_size must be a positive size up to 4 EiB, like 5GB or 500MiB, got {size!r}")
    return int(value)


def cast_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """Floating tensors take the output dtype; integer ones keep theirs."""
    return dtype if dtype is not None and saved.is_floating_point else saved


def cast(tensor: torch.Tensor, dtype: torch.dtype | None, name: str) -> torch.Tensor:
    """``tensor`` in ``dtype`` (floating tensors; integer ones as they are), refused where a finite
    value overflows it (an fp16 output beyond 65,504 would be written as inf)."""
    target = cast_dtype(tensor.dtype, dtype)
    if target == tensor.dtype:
        return tensor
    out = tensor.to(target)
    if torch.finfo(target).max < torch.finfo(tensor.dtype).max:
        overflowed = torch.isinf(out) & torch.isfinite(tensor)
        if overflowed.any():
            largest = tensor[overflowed].abs().max().item()
            raise ExportError(
                f"{name}: {int(overflowed.sum())} values overflow {dtype_name(target)} (largest magnitude "
                f"{largest:.6g}; {dtype_name(target)} holds up to {torch.finfo(target).max:.6g}): write it in "
                "bfloat16 or float32"
            )
    return out


def export_entries(
    tensors: Iterable[tuple[Sequence[str], torch.dtype, tuple[int, ...]]], dtype: torch.dtype | None
) -> list[Entry]:
    """One entry per name (tied weights are written under each of their names), cast to ``dtype``."""
    return [Entry(name, cast_dtype(saved, dtype), shape) for names, saved, shape in tensors for name in names]


@contextlib.contextmanager
def staged_export(directory: Path, plan: WeightPlan) -> Iterator[dict[str, bool]]:
    """Hold ``directory`` for one write: checked, locked, the plan's files created under their
    temporary names; yields the previous export's weight files. When the block raises, the
    temporary files go, and the folder too if this made it (and nothing else is in it)."""
    check_out(directory, plan.record.made)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with TargetLock.inside(directory):
            previous = check_out(directory, plan.record.made)
            create_staged(directory, plan)
            try:
                yield previous
            except BaseException:
                discard(directory, plan)
                raise
    except BaseException:
        if created:
            with contextlib.suppress(OSError):  # not empty: another writer's files are there
                directory.rmdir()
        raise


def write_spread(
    directory: Path,
    plan: WeightPlan,
    write: Callable[[Slots], Exception | None],
    what: str,
    writers: Writers,
    finish: Callable[[], None] = lambda: None,
) -> Path:
    """The files of ``plan`` written into ``directory`` by ``writers`` (every rank of the process
    group, collective; or this process alone), under an export id of their own (agreed by them).

    The lead prepares the folder (``staged_export``); each writer's ``write(slots)`` writes what it
    writes and returns its error, if any; once every writer has finished, the lead commits, then
    runs ``finish``. A failure anywhere is every writer's, and leaves the previous export whole."""
    plan = plan.with_id(_new_export_id(writers.together))
    error: Exception | None = None
    with contextlib.ExitStack() as held:
        previous: dict[str, bool] = {}
        if writers.lead:
            try:
                previous = held.enter_context(staged_export(directory, plan))
            except Exception as caught:
                error = caught
        writers.agree(error, what)
        writers.agree(write(Slots(directory, plan)), what)
        if writers.lead:
            try:
                commit(directory, plan, previous)
                finish()
            except Exception as caught:
                error = caught
    writers.agree(error, f"committing {what}")
    return directory


def _new_export_id(together: bool) -> str:
    """A new export's id (``weight_files.EXPORT_ID_FORM``): random, the same on every rank when
    ``together`` (the largest of the ranks' draws, one all-reduce)."""
    drawn = torch.tensor([secrets.randbits(48)], dtype=torch.int64)
    if together:
        drawn = drawn.to(comm_device(drawn.device))
        dist.all_reduce(drawn, op=dist.ReduceOp.MAX)
    return f"{int(drawn.item()):012x}"


def write_model(
    directory: str | os.PathLike,
    entries: Sequence[TensorEntry],
    tensors: Iterable[torch.Tensor],
    record: FolderRecord,
    max_bytes: int,
    dtype: torch.dtype | None,
) -> Path:
    """Write ``tensors`` (one full tensor per entry, in order, produced lazily) as safetensors
    weight files into ``directory`` from this process alone (``write_spread``), with ``record``
    of how they were made: a tied tensor under each of its names, floating tensors cast to
    ``dtype``, split in files above ``max_bytes`` (the caller's options, checked: ``write_options``).
    One tensor is held at a time; a failure while writing (an fp16 overflow found on the way)
    leaves the previous export whole. The offline one-process path (export, posthoc)."""
    directory = out_path(directory, record.made)
    planned = export_entries(((entry.names, entry.torch_dtype, entry.shape) for entry in entries), dtype)
    plan = WeightPlan(planned, max_bytes, record)

    def write(slots: Slots) -> None:
        try:
            places = iter(plan.slots)
            described = iter(entries)
            for full in tensors:  # (not zip: its reused tuple would hold a tensor while the next is read)
                entry = next(described)
                full = cast(full, dtype, entry.name)
                for _ in entry.names:
                    slots.write(next(places), full)
                del full  # before the next tensor is read
        finally:
            slots.close()

    return write_spread(directory, plan, write, f"writing {directory}", Writers.of(False, ExportError))
