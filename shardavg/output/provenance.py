"""Provenance: what an export or a merge was made from and how, beside what it wrote.

A model folder gets ``provenance.json`` (written with its weights' ``record.FolderRecord``); a
merge written as an averager's checkpoint carries the same record in its manifest
(``"provenance"``). The record names the inputs (path, step, run id
and the SHA-256 of each one's manifest: ``shardavg.json``, DCP's ``.metadata``, a model's
index or its safetensors header), their weights and schedule, the dtype written, the shardavg,
torch and Python versions, the world size and the command. An input that carries a provenance
of its own keeps it, nested, so a merge of merges says what each merge was made of.
``shardavg inspect`` shows it. It is written beside the weights, never into them, so the weight
files stay the same bytes however many writers wrote them.

Whatever reads a record back (``inspect``, a merge of earlier merges, an export replacing an
earlier one) goes through ``load`` or ``read``: a file of at most ``PROVENANCE_LIMIT`` bytes,
nested at most ``PROVENANCE_DEPTH`` deep, each field of its type (``format.check_provenance``),
or a ``ProvenanceError`` in one line naming the file; never a ``RecursionError``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from ..base.errors import ExportError, ProvenanceError
from ..base.logs import log
from ..base.validate import nesting
from ..checkpoints.format import (
    DCP_METADATA,
    MANIFEST,
    PROVENANCE_DEPTH,
    PROVENANCE_LIMIT,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    check_provenance,
    parse_manifest,
    read_manifest_bytes,
)
from ..checkpoints.storage import open_regular, read_bounded

FILE = "provenance.json"
NESTED = 3  # levels a record nests an input's record under: the record, its inputs, one input
HASH_PIECE = 2**20  # bytes read at a time to hash a manifest
MANIFESTS = (MANIFEST, DCP_METADATA, WEIGHTS_INDEX)


def made_by(what: str, world: int, **details: Any) -> dict[str, Any]:
    """The record of one export, post-hoc synthesis or merge: ``what``, its details, and the software and command."""
    return {
        "made": what,
        **details,
        "world_size": world,
        "shardavg": _version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]],
    }


def _version() -> str:
    """The package's version (read from the loaded package: importing it here would be a cycle)."""
    return getattr(sys.modules.get(__name__.split(".")[0]), "__version__", "unknown")


def of_input(path: Path, step: int | None, weight: float, run_id: str | None = None) -> dict[str, Any]:
    """One input of a merge: where, which step and run, its manifest's hash, its own provenance."""
    folder = path if path.is_dir() else path.parent
    record: dict[str, Any] = {"path": str(path), "step": step, "weight": weight}
    if run_id is not None:
        record["run_id"] = run_id
    digest = manifest_sha256(path)
    if digest is not None:
        record["manifest_sha256"] = digest
    earlier = read(folder)
    if earlier is not None and nesting(earlier, PROVENANCE_DEPTH) > PROVENANCE_DEPTH - NESTED:
        log.info("%s: its provenance is nested too deeply to nest once more: the merge records the input alone", path)
    elif earlier is not None:
        record["provenance"] = earlier
    return record


def manifest_sha256(path: Path) -> str | None:
    """The SHA-256 of what describes the checkpoint at ``path`` (its manifest, or for one
    safetensors file its header), or None where there is none; hashed a bounded piece at a time."""
    folder = path if path.is_dir() else path.parent
    for name in MANIFESTS:
        if (folder / name).is_file():
            return _sha256(folder / name)
    single = path if path.is_file() else folder / WEIGHTS_FILE
    if single.is_file():
        with open(single, "rb") as handle:
            head = handle.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            return _sha256(single, 8, min(length, 100 * 2**20))
    return None


def _sha256(path: Path, start: int = 0, length: int | None = None) -> str:
    """The SHA-256 of ``length`` bytes of the regular file ``path`` from ``start`` (to its end when
    None), read ``HASH_PIECE`` bytes at a time (following a link: a model in the Hugging Face cache)."""
    digest = hashlib.sha256()
    with open(open_regular(path, follow_links=True), "rb") as handle:
        handle.seek(start)
        left = float("inf") if length is None else length
        while left > 0 and (piece := handle.read(int(min(left, HASH_PIECE)))):
            digest.update(piece)
            left -= len(piece)
    return digest.hexdigest()


def check_replaceable(folder: Path) -> None:
    """Refuse a ``provenance.json`` in ``folder`` that shardavg did not write (it would be replaced):
    a link, or anything ``load`` refuses, in one line, before anything is written."""
    path = folder / FILE
    try:
        if path.is_symlink():
            raise ProvenanceError(f"{path} is a link")
        load(path)
    except ProvenanceError as error:
        why = str(error).removeprefix(str(path)).lstrip(": ")  # (the message names the file first)
        raise ExportError(
            f"{path} was not written by shardavg ({why}): it would be replaced; write elsewhere, or move it"
        ) from None


def load(path: Path) -> dict[str, Any] | None:
    """The provenance record in the file ``path`` (a ``provenance.json``), None where there is no
    such file. Anything else there is refused with a ``ProvenanceError`` naming it: not a regular
    file, more than ``PROVENANCE_LIMIT`` bytes (checked before it is read), not JSON, nested
    deeper than ``PROVENANCE_DEPTH``, or not a record as shardavg writes one."""
    where = str(path)
    try:
        raw = read_bounded(path, PROVENANCE_LIMIT, lambda size: _too_large(where, size), follow_links=True)
    except FileNotFoundError:
        return None
    except ProvenanceError:
        raise
    except (OSError, ValueError) as error:  # (a CheckpointError too: a link to a FIFO, a folder)
        raise ProvenanceError(f"cannot read {where}: {error}") from None
    try:
        record = json.loads(raw)
    except RecursionError:
        raise ProvenanceError(f"{where}: nested more than {PROVENANCE_DEPTH} levels deep (PROVENANCE_DEPTH)") from None
    except ValueError as error:  # (UnicodeDecodeError is one)
        raise ProvenanceError(f"{where} is not JSON: {error}") from None
    return check_provenance(record, where)


def _too_large(where: str, size: int) -> ProvenanceError:
    return ProvenanceError(
        f"{where} is {size} bytes, more than a provenance record may hold (PROVENANCE_LIMIT, "
        f"{PROVENANCE_LIMIT // 2**20} MiB)"
    )


def read(folder: Path) -> dict[str, Any] | None:
    """The provenance recorded in ``folder``: its ``provenance.json`` (see ``load``), else the one a
    checkpoint's manifest carries (the manifest checked whole), else None. A record that cannot
    be read raises a ``CheckpointError`` (a ``ProvenanceError`` for the record itself) in one line
    naming the file: what calls this (``inspect``, a merge of earlier merges) never sees a
    malformed record, nor a ``RecursionError``."""
    found = load(folder / FILE)
    if found is not None:
        return found
    try:
        raw = read_manifest_bytes(folder / MANIFEST)
    except FileNotFoundError:
        return None
    return parse_manifest(raw, str(folder / MANIFEST)).provenance


def shown(record: dict[str, Any], depth: int = 0) -> list[str]:
    """A checked record (from ``load``, ``read`` or a parsed description) in lines for
    ``shardavg inspect``, nested inputs indented."""
    pad = "  " * depth
    keys = ("made", "average", "sigma_rel", "schedule", "dtype", "step")
    head = ", ".join(f"{k} {record[k]}" for k in keys if record.get(k))
    lines = [f"{pad}{head}" if head else f"{pad}{record.get('made', '?')}"]
    lines.append(f"{pad}by shardavg {record.get('shardavg')} on torch {record.get('torch')}, "
                 f"{record.get('world_size')} process(es): {' '.join(record.get('command', []))}")  # fmt: skip
    for entry in record.get("inputs", []):
        run = f", run {entry['run_id']}" if entry.get("run_id") else ""
        profile = f", profile {entry['profile']}" if entry.get("profile") else ""
        weight = f"weight {entry['weight']:.6g}"
        lines.append(f"{pad}- {entry['path']} (step {entry.get('step')}{run}{profile}, {weight})")
        if isinstance(entry.get("provenance"), dict):
            lines += shown(entry["provenance"], depth + 1)
    return lines
