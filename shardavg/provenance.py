"""Provenance: what an export or a merge was made from and how, beside what it wrote.

A model folder gets ``provenance.json``; a merge written as an averager's checkpoint carries the
same record in its manifest (``"provenance"``). The record names the inputs (path, step, run id
and the SHA-256 of each one's manifest: ``shardavg.json``, DCP's ``.metadata``, a model's
index or its safetensors header), their weights and schedule, the dtype written, the shardavg,
torch and Python versions, the world size and the command. An input that carries a provenance
of its own keeps it, nested, so a merge of merges says what each merge was made of.
``shardavg inspect`` shows it. It is written beside the weights, never into them, so the weight
files stay the same bytes whoever (how many ranks or workers) wrote them.
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

from .errors import ExportError
from .format import DCP_METADATA, MANIFEST, WEIGHTS_FILE, WEIGHTS_INDEX
from .storage import atomic_file

FILE = "provenance.json"
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
    return getattr(sys.modules.get(__package__ or "shardavg"), "__version__", "unknown")


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
    if earlier is not None:
        record["provenance"] = earlier
    return record


def manifest_sha256(path: Path) -> str | None:
    """The SHA-256 of what describes the checkpoint at ``path`` (its manifest, or for one
    safetensors file its header), or None where there is none."""
    folder = path if path.is_dir() else path.parent
    for name in MANIFESTS:
        if (folder / name).is_file():
            return hashlib.sha256((folder / name).read_bytes()).hexdigest()
    single = path if path.is_file() else folder / WEIGHTS_FILE
    if single.is_file():
        with open(single, "rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0]
            return hashlib.sha256(handle.read(min(length, 100 * 2**20))).hexdigest()
    return None


def check_replaceable(folder: Path) -> None:
    """Refuse a ``provenance.json`` in ``folder`` that shardavg did not write (it would be replaced)."""
    path = folder / FILE
    if path.is_symlink() or (path.exists() and not isinstance(_own(path), dict)):
        raise ExportError(f"{path} was not written by shardavg: it would be replaced; write elsewhere, or move it")


def _own(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and "made" in found and "shardavg" in found else None


def write(folder: Path, record: dict[str, Any]) -> None:
    with atomic_file(folder / FILE) as handle:
        handle.write(json.dumps(record, indent=1).encode())


def read(folder: Path) -> dict[str, Any] | None:
    """The provenance recorded in ``folder`` (a model folder's file, or a checkpoint's manifest), if any."""
    own = _own(folder / FILE)
    if own is not None:
        return own
    try:
        found = json.loads((folder / MANIFEST).read_text()).get("provenance")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def shown(record: dict[str, Any], depth: int = 0) -> list[str]:
    """The record in lines for ``shardavg inspect``, nested inputs indented."""
    pad = "  " * depth
    keys = ("made", "average", "sigma_rel", "schedule", "dtype", "step")
    head = ", ".join(f"{k} {record[k]}" for k in keys if record.get(k))
    lines = [f"{pad}{head}" if head else f"{pad}{record.get('made', '?')}"]
    lines.append(f"{pad}by shardavg {record.get('shardavg')} on torch {record.get('torch')}, "
                 f"{record.get('world_size')} process(es): {' '.join(record.get('command', []))}")  # fmt: skip
    for entry in record.get("inputs", []):
        run = f", run {entry['run_id']}" if entry.get("run_id") else ""
        profile = f", profile {entry['profile']}" if entry.get("profile") else ""
        weight = f"weight {entry.get('weight'):.6g}"
        lines.append(f"{pad}- {entry['path']} (step {entry.get('step')}{run}{profile}, {weight})")
        if isinstance(entry.get("provenance"), dict):
            lines += shown(entry["provenance"], depth + 1)
    return lines
