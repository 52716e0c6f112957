"""Sharded checkpoints of a ``WeightAverager``: ``save``/``load`` and DCP's Stateful protocol.

Both forms store every tensor *flattened*, as the chunks the ranks own (see ``layout.py``),
next to a JSON description of the averager (``AverageState.describe``). Because a chunk is a range of the
flattened tensor, a checkpoint loads at any world size and under any strategy: each rank
reads the parts of the saved chunks that overlap its own range.

``save(directory)`` writes one safetensors file per rank and a ``shardavg.json`` manifest
into a staging directory; the manifest is written last and the directory renamed into place,
so a crash at any point leaves the previous checkpoint intact and an uncommitted directory
that ``load`` refuses. Nothing is ever unpickled: JSON and safetensors only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .errors import CheckpointError
from .layout import agree_or_raise, rank, world_size
from .state import FORMAT, VERSION, AverageState
from .storage import (
    DTYPE_CODES,
    DTYPES,
    Entry,
    atomic_file,
    commit_directory,
    fresh_staging,
    open_safetensors,
    staging_path,
    write_safetensors,
)

MANIFEST = "shardavg.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


def check_description(meta: Any, where: str) -> dict[str, Any]:
    """Refuse anything that is not a description written by this or an older shardavg."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a shardavg checkpoint description")
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{where} has format version {version!r}; this shardavg reads up to {VERSION}")
    missing = [key for key in ("step", "num_updates", "rule", "tensors") if key not in meta]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    return meta


def check_compatible(state: AverageState, meta: dict[str, Any], where: str, strict: bool) -> dict[str, dict]:
    """Compare a checkpoint with the averager; return the saved tensors by name.

    Names and shapes must match (the error lists missing, unexpected and mis-shaped
    tensors); with ``strict=False`` missing and unexpected tensors, and a different rule,
    only warn.
    """
    saved = {entry["name"]: entry for entry in meta["tensors"]}
    mine = {info.name: info for info in state.infos}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    misshaped = sorted(
        f"{name}: checkpoint {tuple(saved[name]['shape'])} vs model {tuple(mine[name].shape)}"
        for name in set(mine) & set(saved)
        if tuple(saved[name]["shape"]) != tuple(mine[name].shape)
    )
    if misshaped or (strict and (missing or unexpected)):
        raise CheckpointError(
            f"{where} does not match this model: missing {missing}, unexpected {unexpected}, mis-shaped {misshaped}"
        )
    if missing or unexpected:
        warnings.warn(
            f"{where}: missing {missing} (averaged from the live weights on), unexpected {unexpected} (ignored)",
            stacklevel=3,
        )
    stored = {info.name: role != "live" for info, role in zip(state.infos, state.roles)}
    restored = sorted(
        f"{name} ({'averaged' if stored[name] else 'live'} here, {saved[name]['role']} in the checkpoint)"
        for name in set(stored) & set(saved)
        if stored[name] != (saved[name]["role"] != "live")
    )
    if restored:
        message = f"{where} stores tensors differently (frozen parameters or buffer policy changed?): {restored}"
        if strict:
            raise CheckpointError(message)
        warnings.warn(message, stacklevel=3)
    rule = state.rule.to_config()
    if meta["rule"] != rule:
        message = f"{where} was averaged with rule {meta['rule']}, this averager has {rule}"
        if strict:
            raise CheckpointError(f"{message}; pass strict=False to load it anyway")
        warnings.warn(message, stacklevel=3)
    return saved


def loadable(state: AverageState, saved: dict[str, dict]) -> list[int]:
    """Indices of tensors to fill from a checkpoint: stored by the averager and saved as such."""
    return [
        index
        for index, (info, shadow) in enumerate(zip(state.infos, state.shadows))
        if shadow is not None and info.name in saved and saved[info.name]["role"] != "live"
    ]


# ------------------------------------------------------------------------- save / load


def _prune(parent: Path, keep_last: int) -> None:
    steps = sorted(
        (int(m.group(1)), p) for p in parent.iterdir() if (m := STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    )
    for _, old in steps[:-keep_last]:
        shutil.rmtree(old)
    for stale in parent.glob(".step-*.incomplete"):  # left by saves that crashed
        shutil.rmtree(stale, ignore_errors=True)


def save(state: AverageState, directory: str | os.PathLike, keep_last: int | None = None) -> Path:
    """Collective: write the averager's shards and manifest to ``directory``, atomically.

    With ``keep_last=K`` the checkpoint goes to ``directory/step-NNNNNNNNN`` and only the K
    newest committed ones are kept. Returns the committed checkpoint's path.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    state.check_current()
    directory = Path(directory)
    target = directory / f"step-{state.step:09d}" if keep_last else directory
    staging = staging_path(target)
    me, ranks = rank(), world_size()
    files = [f"rank-{r:05d}-of-{ranks:05d}.safetensors" for r in range(ranks)]
    error: BaseException | None = None
    if me == 0:
        try:
            fresh_staging(target)
        except OSError as caught:
            error = caught
    agree_or_raise(error, f"creating {staging}")

    owned = [
        (index, start, end)
        for index, chunks in enumerate(state.layout.chunks)
        for owner, start, end in chunks
        if owner == me
    ]
    try:
        entries = [Entry(state.infos[i].name, state.piece(i).dtype, (end - start,)) for i, start, end in owned]
        write_safetensors(staging / files[me], entries, (state.piece(i) for i, _, _ in owned))
    except Exception as caught:  # report it to every rank rather than leave them waiting
        error = caught
    agree_or_raise(error, f"writing shards to {staging}")

    if me == 0:
        try:
            manifest = state.describe() | {"files": files}
            for entry, chunks in zip(manifest["tensors"], state.layout.chunks):
                entry["chunks"] = [{"file": owner, "start": start, "end": end} for owner, start, end in chunks]
            with atomic_file(staging / MANIFEST) as handle:
                handle.write(json.dumps(manifest, indent=1).encode())
            commit_directory(staging, target)
            if keep_last:
                _prune(directory, keep_last)
        except Exception as caught:
            error = caught
    agree_or_raise(error, f"committing {target}")
    return target


def resolve(directory: str | os.PathLike) -> Path:
    """The committed checkpoint at ``directory``: itself, or its newest ``step-*`` subdirectory."""
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return directory
    replaced = directory.with_name(f".{directory.name}.replaced")
    if not directory.exists() and (replaced / MANIFEST).is_file():
        return replaced  # a save crashed between its two renames: the previous one is complete
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}")
    steps = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)))
    committed = [p for _, p in steps if (p / MANIFEST).is_file()]
    if committed:
        return committed[-1]
    uncommitted = [p.name for _, p in steps] or [directory.name]
    raise CheckpointError(
        f"{directory} holds no committed shardavg checkpoint: {uncommitted} lack {MANIFEST}, "
        "so their save never completed"
    )


def read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    try:
        meta = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {manifest_path}: {error}") from error
    meta = check_description(meta, str(manifest_path))
    if not isinstance(meta.get("files"), list) or any("chunks" not in t for t in meta["tensors"]):
        raise CheckpointError(f"{manifest_path} lacks the file and chunk tables")
    return meta


class _Read(NamedTuple):
    """Copy elements ``[source_start, source_end)`` of a saved chunk to ``[target_start, ...)`` of a shadow."""

    index: int
    piece: Any  # a lazy safetensors slice of the saved chunk
    source_start: int
    source_end: int
    target_start: int


def _plan_reads(state: AverageState, path: Path, meta: dict, saved: dict[str, dict], handles: dict) -> list[_Read]:
    """Every read this rank needs, each checked against the file it comes from."""
    reads = []
    for index in loadable(state, saved):
        info, entry = state.infos[index], saved[state.infos[index].name]
        for chunk in entry["chunks"]:
            low, high = max(chunk["start"], info.start), min(chunk["end"], info.end)
            if low >= high:
                continue
            file = path / meta["files"][chunk["file"]]
            if file not in handles:
                handles[file] = open_safetensors(file)
            if info.name not in handles[file].keys():
                raise CheckpointError(f"{file} lacks tensor {info.name!r}")
            piece = handles[file].get_slice(info.name)
            expected = (DTYPE_CODES.get(DTYPES.get(entry["dtype"])), [chunk["end"] - chunk["start"]])
            if (piece.get_dtype(), piece.get_shape()) != expected:
                raise CheckpointError(
                    f"{file}: {info.name!r} is {piece.get_dtype()} {piece.get_shape()}, the manifest says {expected}"
                )
            reads.append(_Read(index, piece, low - chunk["start"], high - chunk["start"], low - info.start))
    return reads


def load(state: AverageState, directory: str | os.PathLike, strict: bool = True) -> Path:
    """Collective: restore the averager from a checkpoint written by ``save``, at any world size
    or strategy. Everything is checked on every rank before any shadow changes."""
    state.verify_structure()
    error: BaseException | None = None
    path = Path(directory)
    try:
        path = resolve(directory)
        meta = read_manifest(path)
        saved = check_compatible(state, meta, str(path), strict)
        reads = _plan_reads(state, path, meta, saved, handles={})
    except Exception as caught:
        error = caught
    agree_or_raise(error, f"loading {path}")
    with torch.no_grad():
        for read in reads:
            target = state.shadows[read.index].view(-1)
            target[read.target_start : read.target_start + read.source_end - read.source_start].copy_(
                read.piece[read.source_start : read.source_end]
            )
    state.restore(meta, set(saved))
    return path
