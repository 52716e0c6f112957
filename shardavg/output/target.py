"""OUT: the folder a model folder is written into, checked in one place (``check_out``).

Every writer (``avg.export``, ``shardavg export``, ``posthoc``, ``merge``) checks OUT with
``check_out`` before any work is done, and takes the folder with the same check under its lock
(``model_writer.staged_export``), so what is refused and how it is said is the same for all: an
empty path, a file or a link, a checkpoint or a folder inside one, a folder that is an input,
lies inside one or holds one, a ``provenance.json`` or weight files shardavg did not write, and
anything but a regular file where a temporary file goes. A weight file is shardavg's when its
metadata carry shardavg's record (``record.FolderRecord``), or, as ``.NAME.incomplete``, by its
name (an atomic write's leftover).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from ..base.errors import ExportError
from ..base.links import refuse_linked_target
from ..checkpoints.format import DCP_METADATA, MANIFEST, WEIGHTS_INDEX
from ..checkpoints.ownership import enclosing_checkpoint, entries_of, temporary_of
from ..checkpoints.storage import safetensors_metadata, staging_path
from .provenance import FILE as PROVENANCE
from .provenance import check_replaceable
from .record import FolderRecord

# a model folder's weight files (a split model's with its export id in their names; without: older exports)
EXPORT_FILE = re.compile(
    r"^(model\.safetensors|model-([0-9a-f]{12}-)?\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$"
)


def out_path(out: str | os.PathLike, what: str) -> Path:
    """``out`` as the folder ``what`` writes into: never an empty path (which would silently mean the
    current folder)."""
    if not os.fspath(out):
        raise ValueError(f"{what}: the path is empty (OUT is empty): name the folder to write into, . for this one")
    return Path(out)


def check_out(
    out: str | os.PathLike,
    what: str,
    inputs: Sequence[Path] = (),
    *,
    replaces_checkpoint: bool = False,
    beside: bool = False,
) -> dict[str, bool]:
    """Refuse OUT where ``what`` must not write: a file or a link, inside a checkpoint (or a
    post-hoc snapshot), a checkpoint itself (unless the output ``replaces_checkpoint``, as a merge
    into an averager's checkpoint does), an input, inside one, or (unless it may go ``beside``
    them, as an export that writes only its own files does) holding one; a model folder holding
    a ``provenance.json`` or weight files shardavg did not write, or anything but a regular file
    where a temporary file goes. Returns the weight files it holds, each with whether it is
    shardavg's (the previous export, which the write replaces).

    Raises:
        ValueError: an empty ``out``.
        ExportError: naming OUT and what is in the way.
    """
    path = out_path(out, what)
    refuse_linked_target(path, ExportError)
    if path.exists() and not path.is_dir():
        raise ExportError(f"{out} exists and is not a folder: shardavg will not replace it")
    enclosing = enclosing_checkpoint(path.parent)
    if enclosing is not None:
        raise ExportError(f"OUT {out} is inside the checkpoint {enclosing}: write to a folder of its own")
    if not replaces_checkpoint and ((path / MANIFEST).exists() or (path / DCP_METADATA).exists()):
        raise ExportError(f"OUT {out} is a checkpoint: export into a model folder of its own")
    target = path.resolve()
    for given in inputs:
        source = given.resolve()
        if target == source or source in target.parents or (target in source.parents and not beside):
            raise ExportError(f"OUT {out} and the input {given} lie one inside the other: write to a folder apart")
    if replaces_checkpoint:
        return {}
    check_replaceable(path)
    _check_temporary(path / PROVENANCE)  # (a merge writes it after the weights)
    present = export_files(path)
    foreign = sorted(name for name, own in present.items() if not own)
    if foreign:
        raise ExportError(
            f"{path} holds weight files shardavg did not write ({', '.join(foreign)}): they would be "
            "replaced; export into another folder, or move them"
        )
    return present


def _check_temporary(path: Path) -> None:
    """Refuse anything but a regular file (an earlier write's leftover) at ``path``'s temporary
    name, before anything is written: a link there would fail the write after the weights were
    committed."""
    temporary = staging_path(path)
    try:
        mode = os.lstat(temporary).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise ExportError(
            f"{temporary} is in the way of a temporary file shardavg writes and is not a regular file (a link?): "
            "shardavg will not write through it; move it"
        )


def is_own_export_file(path: Path) -> bool:
    """A weight file or index whose metadata carry shardavg's record."""
    try:
        if path.name == WEIGHTS_INDEX:
            index = json.loads(path.read_text())
            return FolderRecord.from_metadata(index.get("metadata") if isinstance(index, dict) else None) is not None
        return FolderRecord.from_metadata(safetensors_metadata(path)) is not None
    except Exception:  # unreadable, foreign or truncated: not provably ours
        return False


def export_files(path: Path) -> dict[str, bool]:
    """The weight files in the folder ``path``, each with whether shardavg wrote it."""
    entries = entries_of(path) or {}
    return {
        # an atomic write's leftover is ours by its name; a weight file by its metadata
        name: stat.S_ISREG(st.st_mode) and (temporary or is_own_export_file(path / name))
        for name, st in entries.items()
        if (temporary := temporary_of(name, EXPORT_FILE)) or EXPORT_FILE.match(name)
    }
