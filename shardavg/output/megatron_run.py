"""A merge written as a Megatron-LM run folder, which ``--load OUT`` resumes from.

Megatron-LM's ``--load DIR`` reads the tracker ``DIR/latest_checkpointed_iteration.txt`` (its
``get_checkpoint_tracker_filename``), parses it as its ``read_metadata`` does (the stripped text as
an int above 0, or ``release``), and loads ``DIR/iter_NNNNNNN`` (``get_checkpoint_name``: the
iteration in at least 7 digits). Without a tracker it warns and trains from random weights, which
is what a DCP folder alone gives it. So a merge of Megatron-Core ``torch_dist`` inputs written as
DCP goes into ``OUT/iter_NNNNNNN``, staged and swapped into place whole (``dcp_checkpoint``), and
the tracker is written last (``track``), atomically, naming it: until then ``--load OUT`` finds
OUT as it was (the earlier merge, or nothing).

OUT is the merge's when it is new, empty, or holds nothing but what merges write there
(``check_replaceable``): the tracker, iteration folders that are each a DCP merge of shardavg's
(their ``provenance.json`` says so), and the staging and lock files of one. A Megatron-LM run's
own folder is refused: a merge added to it would become the iteration its next restart resumes
from, with no optimizer state. A re-merge replaces the earlier one: the new iteration is
committed, the tracker moved to it, then the earlier merge's other iteration folders removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from ..base import validate
from ..base.errors import CheckpointError
from ..base.logs import log
from ..checkpoints.format import DCP_METADATA
from ..checkpoints.ownership import LOCK_FILE, TargetLock, entries_of
from ..checkpoints.storage import atomic_file, staging_path
from . import dcp_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's record of the newest finished iteration
ITERATION = re.compile(r"^iter_([0-9]+)$")  # a Megatron-LM run's checkpoint of one iteration
LARGEST = 10**18 - 1  # the largest iteration a tracker may name (18 digits: what a reader accepts)
# what a merge leaves in OUT besides its iterations: the tracker's temporary name, an iteration's
# staging folder, the earlier one a swap keeps for a moment, and the lock beside it
OWN_ENTRY = re.compile(r"^\.iter_[0-9]+\.(incomplete|replaced|lock)$")
LEFT_BEHIND = re.compile(r"^\.iter_[0-9]+\.(incomplete|replaced)$")  # of those, the folders a killed merge leaves


def folder_of(out: Path, iteration: int) -> Path:
    """The folder Megatron-LM loads iteration ``iteration`` of the run ``out`` from."""
    return out / f"iter_{iteration:07d}"


def check_iteration(iteration: object) -> int:
    """``iteration`` as a tracker may name it: an int from 1 (Megatron-LM refuses 0) to ``LARGEST``."""
    validate.count("iteration", iteration, 1)
    if iteration > LARGEST:  # type: ignore[operator]
        raise ValueError(f"iteration must be at most {LARGEST} (what a tracker file holds), got {iteration}")
    return iteration  # type: ignore[return-value]


def check_replaceable(out: Path) -> None:
    """Refuse ``out`` as a Megatron-LM merge's folder unless it is new, empty, or holds nothing but
    what merges write there (see the module); a Megatron-LM run's own folder is refused saying how to
    load a merge into it instead."""
    entries = {name: st for name, st in (entries_of(out) or {}).items() if name != LOCK_FILE}
    iterations = sorted(name for name in entries if ITERATION.match(name))
    unmerged = [name for name in iterations if not _is_merge(out / name)]
    if unmerged or (TRACKER in entries and not iterations):
        shown = _listed(unmerged or [TRACKER])
        raise CheckpointError(
            f"OUT {out} holds a Megatron-LM run ({shown}) that shardavg's merge did not write: a merge added to it "
            "would be the iteration its next --load resumes from, without the optimizer. Merge into a folder of its "
            "own and load it with --load OUT --no-load-optim --no-load-rng (or --finetune)"
        )
    foreign = sorted(name for name, st in entries.items() if name not in iterations and not _own_entry(name, st))
    if foreign:
        shown = _listed(foreign)
        earlier = " (a merge written as one DCP folder by shardavg 0.11 or earlier: move it)" if _is_merge(out) else ""
        raise CheckpointError(
            f"OUT {out} holds files a merge into a Megatron-LM run folder did not write ({shown}){earlier}: name a "
            "new or empty folder"
        )


def _listed(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f", ... {len(names) - limit} more" if len(names) > limit else "")


def _own_entry(name: str, st: os.stat_result) -> bool:
    """Whether an entry of OUT beside its iterations is one a merge writes: the tracker (or its
    temporary name), a regular file; an iteration's staging folder, kept earlier folder or lock
    (``OWN_ENTRY``, each judged by ``dcp_checkpoint.staged`` before it is touched)."""
    tracker = name in (TRACKER, staging_path(Path(TRACKER)).name)
    return (tracker and stat.S_ISREG(st.st_mode)) or bool(OWN_ENTRY.match(name))


def _is_merge(folder: Path) -> bool:
    """Whether ``folder`` is a DCP merge of shardavg's: its record says so, and it holds nothing else."""
    try:
        dcp_checkpoint.check_replaceable(folder)
    except CheckpointError:
        return False
    return bool(entries_of(folder))


@contextlib.contextmanager
def held(out: Path) -> Iterator[None]:
    """Hold ``out`` for one merge (the first writer, from before its iteration is staged until the
    tracker names it): locked beside it, checked again (``check_replaceable``), made where it is new.
    An ``out`` this made is removed again when the block raises and leaves it empty."""
    with TargetLock.beside(out):
        check_replaceable(out)
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            yield
        except BaseException:
            if made:
                with contextlib.suppress(OSError):
                    out.rmdir()  # (only an empty folder: what the failure left)
            raise


def track(out: Path, iteration: int) -> None:
    """Name ``iteration`` in ``out``'s tracker, once its folder is committed (within ``held``): written
    as Megatron-LM writes it (the number alone), under a temporary name then moved into place, so a
    reader finds the earlier iteration or this one, never a partial file; then the earlier merge's
    other iteration folders are removed (each checked again to be a merge's: one that is not is left,
    with a warning), with what killed merges of other iterations left (``dcp_checkpoint.is_own_staging``)."""
    if not (folder_of(out, iteration) / DCP_METADATA).is_file():
        raise CheckpointError(f"{folder_of(out, iteration)} is not committed: the tracker is written only after it")
    with atomic_file(out / TRACKER) as handle:
        handle.write(str(iteration).encode("ascii"))
    for name in sorted(entries_of(out) or {}):
        if ITERATION.match(name) and name != folder_of(out, iteration).name:
            if _is_merge(out / name):
                shutil.rmtree(out / name)
            else:
                log.warning("%s: left in place, no longer the earlier merge's to remove", out / name)
        elif LEFT_BEHIND.match(name) and dcp_checkpoint.is_own_staging(out / name):
            shutil.rmtree(out / name)
