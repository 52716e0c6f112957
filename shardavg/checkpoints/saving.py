"""A save's folder, whoever fills it: the steps around the files of a checkpoint.

``prepare`` (rank 0, under the lock) refuses a target that is not shardavg's own, clears what
crashed saves left and makes the staging folder; the ranks write their shards into it; ``commit``
(rank 0) writes the manifest last and swaps the folder into place; ``prune`` keeps the newest
``keep_last``. The averager's collective ``save`` (``averager/checkpoint.py``) runs these steps around
the ranks' shards, and ``save_whole`` runs them in one process around whole tensors (a merge written
as an averager's checkpoint). Nothing here sees a live average: only descriptions and tensors.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CheckpointError
from ..base.links import refuse_linked_target
from ..layouts.tensor_layout import MeshLayout, world_grid
from .description import Description
from .format import MANIFEST, SAVE_ID_KEY, STEP_DIR, manifest_json, shard_file
from .ownership import (
    STAGING_MARKER,
    TargetLock,
    enclosing_checkpoint,
    foreign_in_checkpoint,
    is_own_checkpoint,
    is_own_staging,
    target_path,
)
from .reading import committed_steps
from .storage import INCOMPLETE, Entry, atomic_file, commit_folder, replaced_path, staging_path, write_safetensors


def _check_not_a_file(path: Path) -> None:
    refuse_linked_target(path, CheckpointError)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a folder: shardavg will not replace it")


def check_outside_checkpoints(directory: Path, target: Path) -> None:
    """A checkpoint holds only its own files: nothing is saved inside one (a single checkpoint at
    ``directory`` itself is refused by ``prepare``, with what to do instead)."""
    enclosing = enclosing_checkpoint(directory.parent)
    if enclosing is not None:
        raise CheckpointError(
            f"{target} would be inside the checkpoint {enclosing}, which holds only its own files: save elsewhere"
        )


def make_folder(directory: Path) -> None:
    _check_not_a_file(directory)
    directory.mkdir(parents=True, exist_ok=True)


def prepare(directory: Path, target: Path, keep_last: int | None) -> int:
    """Rank 0, under the lock: refuse a target that is not ours, clear what earlier crashed saves
    left (only when it is provably ours), and create the staging folder. Returns the save's
    sequence number in ``directory``."""
    _check_not_a_file(directory)
    if keep_last and (directory / MANIFEST).exists():
        raise CheckpointError(
            f"{directory} is a single checkpoint; keep_last=K writes step-* checkpoints into a folder "
            "of their own: save without keep_last, or into another folder"
        )
    sequence = 0
    if keep_last:
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
        for stale in directory.glob(f".step-*{INCOMPLETE}"):  # left by saves that crashed
            if is_own_staging(stale):
                shutil.rmtree(stale)
    _check_not_a_file(target)
    foreign = foreign_in_checkpoint(target)
    if foreign:
        raise CheckpointError(
            f"{target} holds files shardavg did not write ({', '.join(foreign[:8])}"
            f"{', ...' if len(foreign) > 8 else ''}): it replaces only its own checkpoints; save into a new "
            "or empty folder (keep_last=K keeps step-* checkpoints beside other files)"
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


def commit(manifest: dict[str, Any], target: Path) -> None:
    """Rank 0: write the manifest last, then swap the checkpoint into place."""
    staging = staging_path(target)
    with atomic_file(staging / MANIFEST) as handle:
        handle.write(json.dumps(manifest, separators=(",", ":")).encode())
    (staging / STAGING_MARKER).unlink()
    if foreign_in_checkpoint(target):  # written by someone else since prepare looked
        raise CheckpointError(f"{target} changed during the save and is no longer shardavg's own: left alone")
    commit_folder(staging, target)
    replaced = replaced_path(target)
    if is_own_checkpoint(replaced):  # the previous checkpoint, kept by a save interrupted long ago
        shutil.rmtree(replaced)


def prune(directory: Path, keep_last: int) -> None:
    """Remove all but the ``keep_last`` most recently saved of shardavg's own step checkpoints."""
    for _, _, old in committed_steps(directory, own_only=True, readable_only=True)[:-keep_last]:
        shutil.rmtree(old)


def save_whole(directory: str | os.PathLike, description: Description, tensors: Iterable[torch.Tensor]) -> Path:
    """One process, no process group: save ``tensors`` (whole, one per entry of ``description``,
    in order, produced lazily) as the checkpoint a one-rank ``save`` writes, under the same rules
    (its own target only, locked, staged and committed atomically). ``avg.load`` reads it at any
    world size. Returns ``directory``."""
    directory = target_path(directory, "save", replaced_whole=True)
    check_outside_checkpoints(directory, directory)
    entries = description.tensors
    with TargetLock.beside(directory):
        sequence, save_id = prepare(directory, directory, None), secrets.token_hex(16)
        files = [shard_file(0, 1)]
        planned = [Entry(e.name, e.torch_dtype, (e.numel,)) for e in entries]
        flat = (tensor.reshape(-1) for tensor in tensors)
        digest = write_safetensors(staging_path(directory) / files[0], planned, flat, {SAVE_ID_KEY: save_id})
        whole = [MeshLayout(e.shape, world_grid(1), (("replicate",),)) for e in entries]
        commit(manifest_json(description, whole, [digest], sequence, save_id), directory)
    return directory
