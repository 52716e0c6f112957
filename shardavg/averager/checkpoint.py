"""Sharded checkpoints of a ``WeightAverager``: ``save``, ``load`` and ``check`` (DCP's Stateful
protocol is ``stateful.py``; the folder's own steps, which know no live state, are
``checkpoints/saving.py``).

``save`` runs this sequence, every step on every rank unless named; a failure on any rank at a step
is raised on all of them there (``gather_or_raise``, ``agree_or_raise``), never left to hang:

0) (all ranks) ``state.check_current()``; under the replicated strategy, ``refuse_unlike_replicas``
   (one all-reduce of a digest per parameter).
1) (rank 0) ``check_outside_checkpoints``; take the ``TargetLock``; ``saving.prepare`` (refuse a
   target that is not shardavg's, clear crashed saves, make the staging folder); draw the save id.
2) (all ranks) receive the save's sequence number and id from rank 0 (``gather_or_raise``).
3) (all ranks) write the parts this rank owns into its own shard file in the staging folder
   (``write_safetensors``, hashed as written); every file's digest goes to rank 0.
4) (rank 0) ``state.describe()``; ``saving.commit``: the manifest written last, the folder swapped
   into place. (all ranks) agree on the commit.
5) (rank 0, with ``keep_last``) ``saving.prune``; a failure there is a warning: the save is committed.

``load`` and ``check`` run ``_open_for_load``: (all ranks) open the newest committed save
(``reading.open_checkpoint``: the manifest parsed whole), check it against the averager
(``check_compatible``, ``loadable``), open the files shared out over the ranks, plan every read,
and with ``verify`` hash their share of the files; then (all ranks) exchange reports
(``all_gathered``): one rank's failure is every rank's, and a save committed meanwhile makes
every rank open again. ``check`` stops there; ``load`` then (all ranks) reads its boxes into the
shadows and restores the counters (``state.resume``), with no collective.

Both forms (``save`` and DCP's Stateful) store every tensor as the parts the ranks own (see
``layouts/shard_layout.py``): boxes of the global tensor, with a JSON description of the averager
(``AverageState.describe``). Because a chunk is a box of the tensor itself, a checkpoint loads
under any layout, world size and strategy: each rank reads the parts of the saved boxes that
overlap its own.

``save(directory)`` writes one safetensors file per rank and a checksummed ``shardavg.json``
manifest into a staging folder; the manifest is written last and the folder swapped
into place, so a crash at any point leaves the previous checkpoint intact and an uncommitted
folder that ``load`` refuses. Every shard carries the save's id, and the manifest the id and
every file's size and SHA-256, hashed as the file was written. It replaces only a checkpoint of
its own (``checkpoints/ownership.py``), holds a lock on the target while writing, and with
``keep_last`` removes only its own older ``step-*`` checkpoints. ``load`` reads one save whole even
while another process saves into the same place (``checkpoints/reading.py``). Nothing is ever unpickled: JSON
and safetensors only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from ..base import validate
from ..base.dist import agree_or_raise, all_gathered, gather_or_raise, rank, world_size
from ..base.errors import CheckpointError
from ..checkpoints.description import Description, TensorEntry, tensor_key
from ..checkpoints.format import SAVE_ID_KEY, manifest_json, saved_length, shard_file, step_folder
from ..checkpoints.ownership import (
    TargetLock,
    target_path,
)
from ..checkpoints.reading import (
    ATTEMPTS,
    CheckpointReplaced,
    OpenCheckpoint,
    busy_error,
    open_checkpoint,
    reserve_descriptors,
)
from ..checkpoints.saving import check_outside_checkpoints, commit, make_folder, prepare, prune
from ..checkpoints.storage import (
    Entry,
    SafetensorsFile,
    staging_path,
    write_safetensors,
)
from ..layouts.parts import Part, box_slices, intersect
from ..strategies import refuse_unlike_values
from ..update.options import Options
from .average_state import AverageState


def check_compatible(state: AverageState, saved_state: Description, where: str, strict: bool) -> dict[str, TensorEntry]:
    """Compare a checkpoint with the averager; return the saved tensors by this averager's names.

    Names and shapes must match (the error lists missing, unexpected and mis-shaped
    tensors); with ``strict=False`` missing and unexpected tensors, other averages and a
    different rule only warn. Ties need not match: a tied tensor is read from the saved entry of
    its first name the checkpoint holds (a checkpoint of an untied model, or a merge, holds each
    name apart), and a name tied in the checkpoint serves every tensor of this model it names.
    """
    by_name = saved_state.by_name()
    mine = {info.name: info for info in state.infos}
    saved = {
        info.name: by_name[found]
        for info in state.infos
        if (found := next((name for name in info.names if name in by_name), None)) is not None
    }
    names = {name for info in state.infos for name in info.names}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(e.name for e in saved_state.tensors if not names & set(e.names))
    misshaped = sorted(
        f"{name}: checkpoint {saved[name].shape} vs model {tuple(mine[name].shape)}"
        for name in saved
        if saved[name].shape != tuple(mine[name].shape)
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
        f"{name} ({'averaged' if stored[name] else 'live'} here, {saved[name].role} in the checkpoint)"
        for name in saved
        if stored[name] != (saved[name].role != "live")
    )
    if restored:
        message = f"{where} stores tensors differently (frozen parameters or buffer policy changed?): {restored}"
        if strict:
            raise CheckpointError(message)
        warnings.warn(message, stacklevel=3)
    _compare_patterns(state, saved_state, where, strict)
    _compare_averages(state, saved_state, where, strict)
    return saved


def _compare_patterns(state: AverageState, saved_state: Description, where: str, strict: bool) -> None:
    """``include`` and ``exclude`` decide which tensors a checkpoint holds averaged and which
    copied, so a checkpoint saved under other patterns is refused (with ``strict=False``, warned
    of and loaded), as one of another rule is; one saved before they existed has none."""
    saved = Options() if saved_state.options is None else saved_state.options  # (None: before format 2)

    def shown(patterns: tuple[str, ...] | None) -> list[str] | None:
        return None if patterns is None else list(patterns)

    differ = [
        f"{name}={shown(getattr(saved, name))} in the checkpoint, {name}={shown(getattr(state.options, name))} here"
        for name in ("include", "exclude")
        if getattr(saved, name) != getattr(state.options, name)
    ]
    if not differ:
        return
    message = f"{where} was saved with other patterns: {'; '.join(differ)}"
    if strict:
        raise CheckpointError(f"{message}; build the averager with the checkpoint's, or pass strict=False to load it")
    warnings.warn(f"{message}; a tensor averaged in one, copied in the other starts from its saved value", stacklevel=4)


def _compare_averages(state: AverageState, saved_state: Description, where: str, strict: bool) -> None:
    mine = {average.name: average.rule.to_config() for average in state.averages.values()}
    theirs = {average.name: average.rule for average in saved_state.averages}
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


class ToLoad(NamedTuple):
    """A shadow to fill from a checkpoint: tensor ``index`` of ``average`` (``None`` for a copied
    tensor's shared shadow), saved here under ``key`` and in the checkpoint under ``saved_key``."""

    index: int
    average: str | None
    key: str
    saved_key: str


def loadable(state: AverageState, saved: dict[str, TensorEntry], saved_state: Description) -> list[ToLoad]:
    """The shadows to fill from a checkpoint: stored by the averager, saved as such, and of an
    average the checkpoint holds."""
    saved_averages = saved_state.average_names
    slots = []
    for index, info in enumerate(state.infos):
        entry = saved.get(info.name)
        if not state.stored(index) or entry is None or entry.role == "live":
            continue
        for key, average in state.keys(index):
            source = average if average is not None else saved_averages[0]
            if source not in saved_averages:
                continue
            saved_key = tensor_key(source, entry.name) if entry.role == "average" else entry.name
            slots.append(ToLoad(index, average, key, saved_key))
    return slots


# ------------------------------------------------------------------------- save / load


def refuse_unlike_replicas(
    state: AverageState, what: str, averages: Sequence[str | None] = (None,), live: bool = False
) -> None:
    """Collective, where a collective read of the averager begins (export, ``full_state_dict``,
    ``copy_to``, ``save``): under the replicated strategy, refuse ``what`` unless every rank holds
    the same values of each parameter it is about to read, one all-reduce of a digest per
    parameter (``strategies.replicated``). Exactly the values read are compared: the averages
    named (with ``live``, the live weights), and the live values of parameters not averaged.
    Buffers are not compared: ranks may hold their own (BatchNorm statistics), and the owner's is
    the one written. The update counts ride along, so that ranks that applied different updates
    are left to ``check_ranks_agree``, which says so.

    Raises:
        StrategyError: Two ranks hold different values of a parameter (on every rank).
    """
    if not state.strategy.copies_everywhere or world_size() == 1:
        return
    me, several = rank(), len(state.averages) > 1
    read: list[tuple[int, str | None]] = []
    for index, info in enumerate(state.infos):
        if info.kind == "param":
            averaged = not live and state.roles[index] == "average"
            read += [(index, average) for average in averages] if averaged else [(index, None)]
    error: BaseException | None = None
    values: list[torch.Tensor | None] = [None] * len(read)
    try:
        state.updater.settle()  # (the counts compared are those the later checks read)
        for position, (index, average) in enumerate(read):
            if state.layout.holds_whole(index, me):
                values[position] = state.flat_part(index, average, live)
    except Exception as caught:  # raised on every rank, alike, by the collective below
        error = caught
    labels = [
        repr(state.infos[index].name)
        + (" (live)" if live else f" in the average {average!r}" if several and average is not None else "")
        for index, average in read
    ]
    counts = [state.num_updates, state.num_skipped]
    refuse_unlike_values(values, labels, what, state.gather_bucket_bytes, counts, error)


def save(
    state: AverageState, directory: str | os.PathLike, keep_last: int | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Collective: write the averager's shards and manifest to ``directory``, atomically.

    With ``keep_last=K`` the checkpoint goes to ``directory/step-NNNNNNNNN`` and only the K most
    recently saved of shardavg's own ones are kept. ``dtype`` stores the averaged tensors in that
    dtype (loading casts them back to the shadows'; copied and live ones are stored as they are).
    Returns the committed checkpoint's path.
    """
    validate.count("keep_last", keep_last, 1, optional=True)
    validate.floating_dtype("dtype", dtype)

    def cast(index: int) -> bool:
        return dtype is not None and state.roles[index] == "average"

    def stored(index: int, average: str | None) -> torch.Tensor:
        local = packed(state.infos[index].part, state.flat_part(index, average))
        return local.to(dtype) if cast(index) else local

    state.check_current()
    refuse_unlike_replicas(state, f"saving {directory}", state.names)
    directory = target_path(directory, "save", replaced_whole=not keep_last)
    target = directory / step_folder(state.step) if keep_last else directory
    staging = staging_path(target)
    me, ranks = rank(), world_size()
    files = [shard_file(r, ranks) for r in range(ranks)]
    with contextlib.ExitStack() as held:
        error: BaseException | None = None
        identity = None  # the save's sequence number in its folder and its id, decided by rank 0
        if me == 0:
            try:
                check_outside_checkpoints(directory, target)
                if keep_last:
                    make_folder(directory)
                held.enter_context(TargetLock.inside(directory) if keep_last else TargetLock.beside(directory))
                identity = (prepare(directory, target, keep_last), secrets.token_hex(16))
            except Exception as caught:
                error = caught
        sequence, save_id = gather_or_raise(error, identity, f"preparing {target}")[0]

        owned = [index for index in range(len(state.infos)) if state.layout.owns(index, me)]
        written = [(i, key, average) for i in owned for key, average in state.keys(i)]  # in file order
        digest = None
        try:
            entries = [
                Entry(key, dtype if cast(i) else state.flat_part(i, a).dtype, (state.infos[i].local_numel,))
                for i, key, a in written
            ]
            stream = (stored(i, a) for i, _, a in written)
            digest = write_safetensors(staging / files[me], entries, stream, {SAVE_ID_KEY: save_id})
        except Exception as caught:  # report it to every rank rather than leave them waiting
            error = caught
        digests = gather_or_raise(error, digest, f"writing shards to {staging}")

        if me == 0:
            try:
                description = state.describe(stored_dtype=dtype)
                commit(manifest_json(description, state.layout.layouts, digests, sequence, save_id), target)
            except Exception as caught:
                error = caught
        agree_or_raise(error, f"committing {target}")
        if me == 0 and keep_last:
            try:
                prune(directory, keep_last)
            except Exception as caught:  # the checkpoint is committed: pruning is housekeeping
                warnings.warn(f"{target} is saved, but removing older checkpoints failed: {caught}", stacklevel=2)
    return target


class _Read(NamedTuple):
    """Copy the box ``offsets .. offsets + target.shape`` of a saved chunk (a row-major box of
    ``sizes``, from element ``at`` of ``key``) into ``target``, a view of a shadow."""

    target: torch.Tensor
    file: SafetensorsFile
    key: str
    at: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]


def _plan_reads(state: AverageState, opened: OpenCheckpoint, slots: list[ToLoad]) -> list[_Read]:
    """Every read this rank needs, each checked against the file it comes from (opened here, so
    what is read later is this save's whatever happens to the folder)."""
    saved = {entry.name: entry for entry in opened.description.tensors}
    reserve_descriptors(len(opened.description.files))
    reads = []
    for slot in slots:
        info = state.infos[slot.index]
        entry, local = saved[info.name], state.flat_part(slot.index, slot.average)
        layout = entry.layout
        for block in info.part.blocks:
            for owner, stored in layout.candidates((block.offsets, block.sizes)):
                common = intersect((block.offsets, block.sizes), (stored.offsets, stored.sizes))
                if common is None:
                    continue
                file = opened.shard(owner)
                file.checked(slot.saved_key, entry.dtype, saved_length(layout, owner))
                target = block.view(local)[box_slices(_minus(common[0], block.offsets), common[1])]
                reads.append(
                    _Read(target, file, slot.saved_key, stored.at, stored.sizes, _minus(common[0], stored.offsets))
                )
    return reads


def _minus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b))


def _open_for_load(
    state: AverageState, directory: str | os.PathLike, strict: bool, verify: bool
) -> tuple[OpenCheckpoint, list[ToLoad], list[_Read]]:
    """Collective: the checkpoint opened on every rank, the same save on all of them (a save
    committed while the ranks open it makes them all open the newer one), checked whole, with
    every read planned. With ``verify`` the ranks share the hashing of its files."""
    for _ in range(ATTEMPTS):
        error: BaseException | None = None
        opened, slots, reads, replaced = None, [], [], False
        try:
            opened = open_checkpoint(directory)
            saved = opened.description
            slots = loadable(state, check_compatible(state, saved, str(opened.path), strict), saved)
            reserve_descriptors(len(saved.files))
            for index in range(rank(), len(saved.files), world_size()):  # every file, the ranks sharing them,
                opened.shard(index)  # there and of its size before any layout the manifest claims is worked out
            reads = _plan_reads(state, opened, slots)
            if verify:
                opened.verify(list(range(len(saved.files)))[rank() :: world_size()])
        except CheckpointReplaced:
            replaced = True
        except Exception as caught:
            error = caught
        reports = all_gathered((None if error is None else f"{type(error).__name__}: {error}", replaced,
                                None if opened is None else opened.identity))  # fmt: skip
        failed = "; ".join(f"rank {r}: {e}" for r, (e, _, _) in enumerate(reports) if e is not None)
        if failed:
            if opened is not None:
                opened.close()
            raise CheckpointError(f"loading {directory} failed: {failed}") from error
        if not any(again for _, again, _ in reports) and len({identity for _, _, identity in reports}) == 1:
            return opened, slots, reads  # type: ignore[return-value]
        if opened is not None:  # some rank saw another save: all open again
            opened.close()
    raise busy_error(directory)


def check(state: AverageState, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
    """Collective: everything ``load`` checks (every file there and this save's, the manifest, the
    averages, names and shapes against this averager), changing nothing; the checkpoint's path."""
    opened, _, _ = _open_for_load(state, directory, strict, verify)
    opened.close()
    return opened.path


def load(state: AverageState, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
    """Collective: restore the averager from a checkpoint written by ``save``, at any world size
    or strategy. Everything is checked on every rank before any shadow changes; ``verify`` also
    hashes every file against the manifest first."""
    state.verify_structure()
    opened, slots, reads = _open_for_load(state, directory, strict, verify)
    with opened, torch.no_grad():
        for read in reads:
            read.file.read_box(read.target, read.key, read.at, read.sizes, read.offsets)
    state.resume(opened.description, {slot.key for slot in slots})
    return opened.path


def packed(part: Part, local: torch.Tensor) -> torch.Tensor:
    """A local part ``local`` as it is saved: its boxes back to back (itself when they are)."""
    if part.dense:
        return local
    return torch.cat([block.view(local).reshape(-1) for block in part.blocks])
