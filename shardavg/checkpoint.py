"""Sharded checkpoints of a ``WeightAverager``: ``save``/``load`` and DCP's Stateful protocol.

Both forms store every tensor *flattened*, as the chunks the ranks own (see ``layout.py``),
next to a JSON description of the averager (``AverageState.describe``). Because a chunk is a range of the
flattened tensor, a checkpoint loads at any world size and under any strategy: each rank
reads the parts of the saved chunks that overlap its own range.

``save(directory)`` writes one safetensors file per rank and a checksummed ``shardavg.json``
manifest into a staging directory; the manifest is written last and the directory swapped
into place, so a crash at any point leaves the previous checkpoint intact and an uncommitted
directory that ``load`` refuses. It replaces only a checkpoint of its own (``ownership.py``),
holds a lock on the target while writing, and with ``keep_last`` removes only its own older
``step-*`` checkpoints. Nothing is ever unpickled: JSON and safetensors only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .description import check_description, fail, is_count, numel, with_checksum
from .errors import CheckpointError
from .layout import agree_or_raise, rank, tiles, world_size
from .ownership import (
    CHECKPOINT_FILE,
    MANIFEST,
    STAGING_MARKER,
    TargetLock,
    foreign_in_checkpoint,
    is_own_checkpoint,
    is_own_staging,
)
from .state import AverageState, tensor_key
from .storage import (
    Entry,
    atomic_file,
    checked_slice,
    commit_directory,
    dtype_name,
    open_safetensors,
    replaced_path,
    staging_path,
    write_safetensors,
)

STEP_DIR = re.compile(r"^step-(\d+)$")


def check_compatible(state: AverageState, meta: dict[str, Any], where: str, strict: bool) -> dict[str, dict]:
    """Compare a checkpoint with the averager; return the saved tensors by name.

    Names and shapes must match (the error lists missing, unexpected and mis-shaped
    tensors); with ``strict=False`` missing and unexpected tensors, other averages and a
    different rule only warn.
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
    _compare_averages(state, meta, where, strict)
    return saved


def _compare_averages(state: AverageState, meta: dict[str, Any], where: str, strict: bool) -> None:
    mine = {average.name: average.rule.to_config() for average in state.averages.values()}
    theirs = {entry["name"]: entry["rule"] for entry in meta["averages"]}
    messages = []
    if mine.keys() != theirs.keys():
        messages.append(
            f"{where} holds averages {list(theirs)}, this averager keeps {list(mine)} (those not in both are "
            "averaged from the live weights on, or ignored)"
        )
    for name in mine.keys() & theirs.keys():
        if mine[name] != theirs[name]:
            which = "" if name is None else f" {name!r}"
            messages.append(f"{where} was averaged{which} with rule {theirs[name]}, this averager has {mine[name]}")
    if messages and strict:
        raise CheckpointError("; ".join(messages) + "; pass strict=False to load it anyway")
    for message in messages:
        warnings.warn(message, stacklevel=4)


class Slot(NamedTuple):
    """A shadow to fill from a checkpoint: tensor ``index`` of ``average`` (``None`` for a copied
    tensor's shared shadow), saved here under ``key`` and in the checkpoint under ``saved_key``."""

    index: int
    average: str | None
    key: str
    saved_key: str


def loadable(state: AverageState, saved: dict[str, dict], meta: dict[str, Any]) -> list[Slot]:
    """The shadows to fill from a checkpoint: stored by the averager, saved as such, and of an
    average the checkpoint holds."""
    saved_averages = [entry["name"] for entry in meta["averages"]]
    slots = []
    for index, info in enumerate(state.infos):
        entry = saved.get(info.name)
        if not state.stored(index) or entry is None or entry["role"] == "live":
            continue
        for key, average in state.keys(index):
            source = average if average is not None else saved_averages[0]
            if source not in saved_averages:
                continue
            saved_key = tensor_key(source, info.name) if entry["role"] == "average" else info.name
            slots.append(Slot(index, average, key, saved_key))
    return slots


# ------------------------------------------------------------------------- save / load


def _sequence(path: Path) -> int:
    """The save's place in its directory's history (older checkpoints without one come first)."""
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {error}") from error
    sequence = meta.get("sequence", -1) if isinstance(meta, dict) else None
    if not is_count(sequence, -1):
        raise CheckpointError(f"{path / MANIFEST}: 'sequence' must be an integer, got {sequence!r}")
    return sequence


def committed_steps(
    directory: Path, own_only: bool = False, readable_only: bool = False
) -> list[tuple[int, int, Path]]:
    """``(sequence, step, path)`` of the committed ``step-*`` checkpoints, oldest save first.

    A manifest that cannot be read raises (which one is newest is then unknown), or with
    ``readable_only`` is left out with a warning (a save or a prune goes on without it)."""
    found = []
    for path in directory.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (is_own_checkpoint(path) if own_only else (path / MANIFEST).is_file()):
            try:
                found.append((_sequence(path), int(match.group(1)), path))
            except CheckpointError as error:
                if not readable_only:
                    raise
                warnings.warn(f"{error}: left out of the save order and never pruned", stacklevel=2)
    return sorted(found)


def _check_not_a_file(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CheckpointError(f"{path} exists and is not a directory: shardavg will not replace it")


def _make_directory(directory: Path) -> None:
    _check_not_a_file(directory)
    directory.mkdir(parents=True, exist_ok=True)


def _prepare(directory: Path, target: Path, keep_last: int | None) -> int:
    """Rank 0, under the lock: refuse a target that is not ours, clear what earlier crashed saves
    left (only when it is provably ours), and create the staging directory. Returns the save's
    sequence number in ``directory``."""
    _check_not_a_file(directory)
    sequence = 0
    if keep_last:
        if (directory / MANIFEST).exists():
            raise CheckpointError(
                f"{directory} is a single checkpoint; keep_last=K writes step-* checkpoints into a directory "
                "of their own: save without keep_last, or into another directory"
            )
        committed = committed_steps(directory, readable_only=True)
        sequence = 1 + max((number for number, _, _ in committed), default=-1)
        step = int(STEP_DIR.match(target.name).group(1))  # type: ignore[union-attr]
        later = [path.name for _, saved_step, path in committed if saved_step > step]
        if later:
            warnings.warn(
                f"saving step {step} into {directory}, which holds later steps {later} (a run restarted from an "
                "earlier checkpoint?): they are kept, but this save is now the newest, the one load() returns",
                stacklevel=4,
            )
        for stale in directory.glob(".step-*.incomplete"):  # left by saves that crashed
            if is_own_staging(stale):
                shutil.rmtree(stale)
    _check_not_a_file(target)
    foreign = foreign_in_checkpoint(target)
    if foreign:
        raise CheckpointError(
            f"{target} holds files shardavg did not write ({', '.join(foreign[:8])}"
            f"{', ...' if len(foreign) > 8 else ''}): it replaces only its own checkpoints; save into a new "
            "or empty directory (keep_last=K keeps step-* checkpoints beside other files)"
        )
    replaced = replaced_path(target)
    if target.exists() and is_own_checkpoint(replaced):  # an interrupted replacement of a complete target
        shutil.rmtree(replaced)
    staging = staging_path(target)
    if staging.exists() or staging.is_symlink():
        if not is_own_staging(staging):
            raise CheckpointError(f"{staging} is in the way and was not written by shardavg: move it")
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    (staging / STAGING_MARKER).touch()
    return sequence


def _commit(
    state: AverageState, directory: Path, target: Path, files: list[str], sequence: int, dtype: torch.dtype | None
) -> None:
    """Rank 0: write the manifest last, swap the checkpoint into place, then prune."""
    staging = staging_path(target)
    manifest = state.describe() | {"files": files, "sequence": sequence}
    for entry, chunks in zip(manifest["tensors"], state.layout.chunks):
        entry["chunks"] = [{"file": owner, "start": start, "end": end} for owner, start, end in chunks]
        if dtype is not None and entry["role"] == "average":
            entry["dtype"] = dtype_name(dtype)
    with atomic_file(staging / MANIFEST) as handle:
        handle.write(json.dumps(with_checksum(manifest), indent=1).encode())
    (staging / STAGING_MARKER).unlink()
    if foreign_in_checkpoint(target):  # written by someone else since _prepare looked
        raise CheckpointError(f"{target} changed during the save and is no longer shardavg's own: left alone")
    commit_directory(staging, target)
    replaced = replaced_path(target)
    if is_own_checkpoint(replaced):  # the previous checkpoint, kept by a save interrupted long ago
        shutil.rmtree(replaced)


def _prune(directory: Path, keep_last: int) -> None:
    """Remove all but the ``keep_last`` most recently saved of shardavg's own step checkpoints."""
    for _, _, old in committed_steps(directory, own_only=True, readable_only=True)[:-keep_last]:
        shutil.rmtree(old)


def save(
    state: AverageState, directory: str | os.PathLike, keep_last: int | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Collective: write the averager's shards and manifest to ``directory``, atomically.

    With ``keep_last=K`` the checkpoint goes to ``directory/step-NNNNNNNNN`` and only the K most
    recently saved of shardavg's own ones are kept. ``dtype`` stores the averaged tensors in that
    dtype (loading casts them back to the shadows'; copied and live ones are stored as they are).
    Returns the committed checkpoint's path.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")

    def cast(index: int) -> bool:
        return dtype is not None and state.roles[index] == "average"

    def stored(index: int, average: str | None) -> torch.Tensor:
        piece = state.piece(index, average)
        return piece.to(dtype) if cast(index) else piece

    state.check_current()
    directory = Path(directory)
    target = directory / f"step-{state.step:09d}" if keep_last else directory
    staging = staging_path(target)
    me, ranks = rank(), world_size()
    files = [f"rank-{r:05d}-of-{ranks:05d}.safetensors" for r in range(ranks)]
    with contextlib.ExitStack() as held:
        error: BaseException | None = None
        sequence = 0
        if me == 0:
            try:
                if keep_last:
                    _make_directory(directory)
                held.enter_context(TargetLock.inside(directory) if keep_last else TargetLock.beside(directory))
                sequence = _prepare(directory, target, keep_last)
            except Exception as caught:
                error = caught
        agree_or_raise(error, f"preparing {target}")

        owned = [
            (index, start, end)
            for index, chunks in enumerate(state.layout.chunks)
            for owner, start, end in chunks
            if owner == me
        ]
        chunks = [(i, key, average, start, end) for i, start, end in owned for key, average in state.keys(i)]
        try:
            entries = [
                Entry(key, dtype if cast(i) else state.piece(i, a).dtype, (end - start,))
                for i, key, a, start, end in chunks
            ]
            write_safetensors(staging / files[me], entries, (stored(i, a) for i, _, a, _, _ in chunks))
        except Exception as caught:  # report it to every rank rather than leave them waiting
            error = caught
        agree_or_raise(error, f"writing shards to {staging}")

        if me == 0:
            try:
                _commit(state, directory, target, files, sequence, dtype)
            except Exception as caught:
                error = caught
        agree_or_raise(error, f"committing {target}")
        if me == 0 and keep_last:
            try:
                _prune(directory, keep_last)
            except Exception as caught:  # the checkpoint is committed: pruning is housekeeping
                warnings.warn(f"{target} is saved, but removing older checkpoints failed: {caught}", stacklevel=2)
    return target


def resolve(directory: str | os.PathLike) -> Path:
    """The committed checkpoint at ``directory``: itself, or its most recently saved ``step-*``."""
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return directory
    if not directory.exists():
        replaced = replaced_path(directory)
        if (replaced / MANIFEST).is_file():
            raise CheckpointError(
                f"no checkpoint at {directory}: a save into it was interrupted between its two renames and left "
                f"the previous checkpoint complete at {replaced}; rename it to {directory.name} to use it"
            )
        raise CheckpointError(f"no checkpoint at {directory}")
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: it is not a directory")
    committed = committed_steps(directory)
    if committed:
        return committed[-1][2]
    uncommitted = sorted(p.name for p in directory.iterdir() if STEP_DIR.match(p.name)) or [directory.name]
    raise CheckpointError(
        f"{directory} holds no committed shardavg checkpoint: {uncommitted} lack {MANIFEST}, "
        "so their save never completed"
    )


def check_chunk_table(meta: dict[str, Any], where: str) -> None:
    """The manifest's files are shardavg's own names, and each tensor's chunks tile it exactly."""
    if meta["version"] >= 2 and "sequence" not in meta:
        raise fail(where, "lacks 'sequence'")
    files = meta.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) and CHECKPOINT_FILE.match(f) for f in files):
        raise fail(where, f"'files' must list rank-NNNNN-of-NNNNN.safetensors names, got {str(files)[:200]}")
    if not files or MANIFEST in files:
        raise fail(where, f"'files' must list the shard files, got {files}")
    for entry in meta["tensors"]:
        chunks = entry.get("chunks")
        if not isinstance(chunks, list) or not all(
            isinstance(c, dict)
            and is_count(c.get("file"))
            and c["file"] < len(files)
            and is_count(c.get("start"))
            and is_count(c.get("end"))
            for c in chunks
        ):
            raise fail(where, f"tensor {entry['name']!r} has a malformed chunk table: {str(chunks)[:200]}")
        spans = [(c["start"], c["end"]) for c in chunks]
        if not tiles(numel(entry["shape"]), spans):
            raise fail(
                where,
                f"the chunks of {entry['name']!r} {spans[:8]} do not cover its {numel(entry['shape'])} elements "
                "exactly once",
            )


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked whole (description, checksum, chunk table)."""
    manifest_path = path / MANIFEST
    try:
        meta = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"cannot read {manifest_path}: {error}") from error
    meta = check_description(meta, str(manifest_path))
    check_chunk_table(meta, str(manifest_path))
    return meta


class _Read(NamedTuple):
    """Copy elements ``[source_start, source_end)`` of a saved chunk to ``[target_start, ...)`` of a shadow."""

    target: torch.Tensor  # the shadow, flat
    piece: Any  # a lazy safetensors slice of the saved chunk
    source_start: int
    source_end: int
    target_start: int


def _plan_reads(state: AverageState, path: Path, meta: dict, slots: list[Slot], handles: dict) -> list[_Read]:
    """Every read this rank needs, each checked against the file it comes from."""
    saved = {entry["name"]: entry for entry in meta["tensors"]}
    reads = []
    for slot in slots:
        info = state.infos[slot.index]
        entry, target = saved[info.name], state.piece(slot.index, slot.average)
        for chunk in entry["chunks"]:
            low, high = max(chunk["start"], info.start), min(chunk["end"], info.end)
            if low >= high:
                continue
            file = path / meta["files"][chunk["file"]]
            if file not in handles:
                handles[file] = open_safetensors(file)
            piece = checked_slice(handles[file], file, slot.saved_key, entry["dtype"], chunk["end"] - chunk["start"])
            reads.append(_Read(target, piece, low - chunk["start"], high - chunk["start"], low - info.start))
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
        slots = loadable(state, check_compatible(state, meta, str(path), strict), meta)
        reads = _plan_reads(state, path, meta, slots, handles={})
    except Exception as caught:
        error = caught
    agree_or_raise(error, f"loading {path}")
    with torch.no_grad():
        for read in reads:
            read.target[read.target_start : read.target_start + read.source_end - read.source_start].copy_(
                read.piece[read.source_start : read.source_end]
            )
    state.restore(meta, {slot.key for slot in slots})
    return path
