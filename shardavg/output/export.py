"""Consolidated export: the full averaged model as safetensors, in the Hugging Face layout, or
as a state dict on rank 0 (``full_state_dict``) or in a plain module on every rank (``copy_to``).

The files are planned once, the same on every rank (``weight_files``). When every rank writes,
each writes the parameters' parts it holds where they lie in the files, with no gather, where
every part is one range of the flattened tensor (``_held_in_ranges``). The rest is spread over
the writer ranks by bytes: each writer receives the tensors it writes (a tensor larger than a
bucket as pieces of its rows, which may go to different writers), a bounded bucket at a time,
in rounds in which every writer receives its own bucket at once, and writes them at their
offsets into files rank 0 created (each rank first proves, through the descriptor it writes with,
that the file is this export's: see ``weight_files``); rank 0 commits once every writer has
finished. So W ranks write about 1/W of the model each, and the folder holds the previous export
or the new one, whole: every export has an id of its own, in its files' metadata and a split
model's file names, so a reader of the index gets one export's files. The offline CLI writes
through ``write_model``, the same files from one process; ``merge`` through ``write_spread`` as
its workers share the tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base import validate
from ..base.dist import agree_or_raise, comm_device, distributed, rank, same_everywhere, world_size
from ..base.dtypes import dtype_name
from ..base.errors import ExportError
from ..checkpoints.ownership import TargetLock, target_path
from ..checkpoints.storage import Entry
from ..state.average_state import AverageState
from ..state.description import Description, TensorEntry
from . import provenance
from .provenance import made_by
from .weight_files import (
    Slot,
    Slots,
    WeightPlan,
    assign,
    check_target,
    commit,
    create_staged,
    discard,
    row_pieces,
)

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


@contextlib.contextmanager
def staged_export(
    directory: Path, plan: WeightPlan, beside: dict[str, bytes] | None = None
) -> Iterator[dict[str, bool]]:
    """Hold ``directory`` for one write: checked, locked, the plan's files (and those ``beside``
    them) created under their temporary names; yields the previous export's weight files. When
    the block raises, the temporary files go, and the folder too if this made it (and nothing
    else is in it)."""
    check_target(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with TargetLock.inside(directory):
            previous = check_target(directory)
            create_staged(directory, plan, beside)
            try:
                yield previous
            except BaseException:
                discard(directory, plan, beside)
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
    finish: Callable[[], None] = lambda: None,
    together: bool = True,
    beside: dict[str, bytes] | None = None,
) -> Path:
    """The files of ``plan`` written into ``directory`` by every rank of the process group
    (collective), or with ``together=False`` (or no process group) by this process alone, under
    an export id of their own (agreed by the ranks).

    Rank 0 prepares the folder (``staged_export``, with the files ``beside`` the weights, name:
    bytes); each rank's ``write(slots)`` writes what it writes and returns its error, if any; once
    every rank has finished, rank 0 commits, then runs ``finish``. A failure anywhere is every
    rank's, and leaves the previous export whole."""
    together = together and distributed()
    plan = plan.with_id(_new_export_id(together))

    def agree(error: Exception | None, doing: str) -> None:
        if together:
            agree_or_raise(error, doing, ExportError)
        elif error is not None:
            raise error

    error: Exception | None = None
    lead = rank() == 0 or not together
    with contextlib.ExitStack() as held:
        previous: dict[str, bool] = {}
        if lead:
            try:
                previous = held.enter_context(staged_export(directory, plan, beside))
            except Exception as caught:
                error = caught
        agree(error, what)
        agree(write(Slots(directory, plan)), what)
        if lead:
            try:
                commit(directory, plan, previous, beside)
                finish()
            except Exception as caught:
                error = caught
    agree(error, f"committing {what}")
    return directory


def _new_export_id(together: bool) -> str:
    """A new export's id (``weight_files.EXPORT_ID_FORM``): random, the same on every rank when
    ``together`` (the largest of the ranks' draws, one all-reduce)."""
    drawn = torch.tensor([secrets.randbits(48)], dtype=torch.int64)
    if together:
        drawn = drawn.to(comm_device(drawn.device))
        dist.all_reduce(drawn, op=dist.ReduceOp.MAX)
    return f"{int(drawn.item()):012x}"


def provenance_file(record: dict[str, Any]) -> dict[str, bytes]:
    """``record`` as the ``provenance.json`` written beside the weights (``write_spread``'s ``beside``):
    staged with them, so that nothing in its way is found only after they were committed."""
    return {provenance.FILE: json.dumps(record, indent=1).encode()}


def write_model(
    directory: str | os.PathLike,
    entries: Sequence[TensorEntry],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str],
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    record: dict[str, Any] | None = None,
) -> Path:
    """Write ``tensors`` (one full tensor per entry, in order, produced lazily) as safetensors
    weight files into ``directory`` from this process alone (``write_spread``): a tied tensor
    under each of its names, floating tensors cast to ``dtype``, ``record`` written beside as
    its provenance. One tensor is held at a time; a failure while writing (an fp16 overflow
    found on the way) leaves the previous export whole. The offline CLI's one output path
    (export, posthoc)."""
    directory = target_path(directory, "export", replaced_whole=False)
    planned = export_entries(((entry.names, entry.torch_dtype, entry.shape) for entry in entries), dtype)
    plan = WeightPlan(planned, parse_size(max_shard_size), metadata)

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

    beside = None if record is None else provenance_file(record)
    return write_spread(directory, plan, write, f"writing {directory}", together=False, beside=beside)


def export_metadata(description: Description, average: str | None, live: bool = False) -> dict[str, str]:
    """What goes into every file's ``__metadata__`` (safetensors wants strings): which average
    (its name and rule; or the live weights), after how many steps and updates, from which engine."""
    which = {"weights": "live"} if live else {"average": average, "rule": description.rule(average)}
    content = which | {
        "step": description.step,
        "num_updates": description.num_updates,
        "strategy": description.strategy,
        "world_size": description.world_size,
    }
    return {"format": "pt", "shardavg": json.dumps(content)}


def export_entries(
    tensors: Iterable[tuple[Sequence[str], torch.dtype, tuple[int, ...]]], dtype: torch.dtype | None
) -> list[Entry]:
    """One entry per name (tied weights are written under each of their names), cast to ``dtype``."""
    return [Entry(name, cast_dtype(saved, dtype), shape) for names, saved, shape in tensors for name in names]


def cast_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """Floating tensors take the export dtype; integer ones keep theirs."""
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


def export(
    state: AverageState,
    path: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    average: str | None = None,
    live: bool = False,
    writers: int | None = None,
) -> Path:
    """Collective: gather ``average`` (or the live weights) and write it as a model folder, its bytes
    spread over ``writers`` ranks (default: every rank; ``1``: rank 0 alone, for a file system
    that cannot take concurrent writers), the same files whatever the number."""
    max_bytes = parse_size(max_shard_size)
    path = target_path(path, "export", replaced_whole=False)
    validate.floating_dtype("dtype", dtype)
    validate.count("writers", writers, 1, optional=True)
    name = None if live else state.average(average).name
    description = state.describe()
    local = (state.flat_part(i, name, live) for i in range(len(state.infos)))
    entries = export_entries(
        ((info.names, part.dtype, tuple(info.shape)) for info, part in zip(state.infos, local)), dtype
    )
    plan = WeightPlan(entries, max_bytes, export_metadata(description, name, live))
    if not same_everywhere([_digest(str(path.resolve())), writers or 0, _digest(json.dumps(plan.sizes))]):
        raise ExportError(
            f"exporting to {path}: the ranks name different folders or writers, or planned different files: every "
            "rank passes the same arguments, and the folder is on a file system every rank sees"
        )
    tensor_of_slot = [index for index, info in enumerate(state.infos) for _ in info.names]
    ranks = _writer_ranks(world_size() if writers is None else min(writers, world_size()))
    held = [] if writers is not None else _held_in_ranges(state)  # (every rank writing: each its own parts)
    largest = min(state.gather_bucket_bytes, max(1, plan.total_bytes // len(ranks)))
    written_held = frozenset(held)
    items = [item for item in _items(tensor_of_slot, plan, largest) if item.index not in written_held]
    owner = assign([item.nbytes for item in items], len(ranks))
    rounds = _rounds([item.nbytes for item in items], owner, len(ranks), state.gather_bucket_bytes)
    order = [items[position] for round_ in rounds for position in round_]
    wanted = [[(items[at].index, ranks[owner[at]], items[at].rows) for at in round_] for round_ in rounds]
    gathered = state.gathered_to(wanted, name, live)  # checks the averager before anything is written
    own = _written_where_held(state, held)
    slots_of: dict[int, list[Slot]] = {}
    for slot, index in zip(plan.slots, tensor_of_slot):
        slots_of.setdefault(index, []).append(slot)

    def write(slots: Slots) -> Exception | None:
        error = _write_held(state, own, name, live, slots, slots_of, dtype)
        return _write_received(gathered, iter(order), slots, plan, dtype, state, error)

    record = made_by(
        "export", world_size(), average="live weights" if live else name, step=description.step,
        num_updates=description.num_updates, run_id=description.run, strategy=description.strategy,
        dtype=None if dtype is None else dtype_name(dtype), writers=len(ranks),
    )  # fmt: skip
    return write_spread(path, plan, write, f"exporting to {path}", beside=provenance_file(record))


def _digest(text: str) -> int:
    """``text`` as one integer below 2**56, for ``same_everywhere``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _held_in_ranges(state: AverageState) -> list[int]:
    """The tensors written where they lie, with no gather: parameters whose every part is one range
    of the flattened tensor (FSDP1/FSDP2/ZeRO shards, rows, replicas). Buffers are gathered from
    their owners: ranks may hold their own values of them (BatchNorm statistics without a
    broadcast), and the owner's is the one written."""
    layouts = state.layout.layouts
    return [i for i, info in enumerate(state.infos) if info.kind == "param" and layouts[i].in_ranges()]


def _written_where_held(state: AverageState, held: list[int]) -> list[int]:
    """Of the tensors ``held`` (each rank's part one range of the flattened tensor), those whose
    part this rank writes where it lies, with no gather: the parts it owns alone, and of a part
    several ranks hold (DDP, HSDP's replicas, buffers), a share by bytes among them (each of them
    makes the same split: they hold the same parts)."""
    me = rank()
    groups: dict[tuple[int, ...], list[int]] = {}
    for index in held:
        layout = state.layout.layouts[index]
        owner = layout.owner_of(me)
        if owner is not None:
            groups.setdefault((owner, *layout.replicas(owner)), []).append(index)
    mine = []
    for holders, indices in groups.items():
        sizes = [state.layout.part(i, me).numel * state.infos[i].dtype.itemsize for i in indices]
        mine += [i for i, writer in zip(indices, assign(sizes, len(holders))) if holders[writer] == me]
    return sorted(mine)


def _write_held(
    state: AverageState,
    own: list[int],
    average: str | None,
    live: bool,
    slots: Slots,
    slots_of: dict[int, list[Slot]],
    dtype: torch.dtype | None,
) -> Exception | None:
    """Write this rank's parts of the tensors ``own`` at their place in the files, at most a bucket
    at a time; return the first error."""
    try:
        for index in own:
            local = state.flat_part(index, average, live)
            start = state.layout.part(index, rank()).flat_range()[0]  # type: ignore[index]
            step = max(state.gather_bucket_bytes, 2**20) // local.element_size()  # (a copy only to cast or move)
            for first in range(0, local.numel(), step):
                piece = cast(local[first : first + step], dtype, state.infos[index].names[0])
                for slot in slots_of[index]:
                    slots.write_elements(slot, piece, start + first)
    except Exception as caught:
        return caught
    return None


def _write_received(
    gathered: Iterable[tuple[int, int | None, torch.Tensor | None]],
    items: Iterator[Item],
    slots: Slots,
    plan: WeightPlan,
    dtype: torch.dtype | None,
    state: AverageState,
    error: Exception | None = None,
) -> Exception | None:
    """Write every tensor (or piece) this rank receives at its slots (``items``: each gathered
    one's, in order); return the first error, ``error`` if given (the collective gather goes on
    to its end all the same, so that the ranks can agree on it)."""
    try:
        for index, _, full in gathered:  # (not zipped: a reused tuple would hold a tensor into the next round)
            item = next(items)
            if full is None or error is not None:
                continue
            try:
                full = cast(full, dtype, state.infos[index].names[0]).to("cpu")
                for slot in item.slots:
                    slots.write(plan.slots[slot], full, item.rows)
            except Exception as caught:
                error = caught
            del full
    finally:
        try:
            slots.close()
        except Exception as caught:
            error = error or caught
    return error


@dataclass(frozen=True)
class Item:
    """What one writer receives at once: tensor ``index`` (its ``rows``, or all of it if None),
    written at its ``slots`` (a tied tensor's names that follow each other in one file)."""

    index: int
    slots: tuple[int, ...]
    rows: tuple[int, int] | None
    nbytes: int  # bytes written


def _items(tensor_of_slot: list[int], plan: WeightPlan, largest: int) -> list[Item]:
    """What is gathered, in the files' order: each tensor, and a tensor of more than ``largest``
    bytes as pieces of consecutive rows of at most that (one row at least), so that no writer
    holds more than a bucket at once and the largest tensors spread over the writers too."""
    grouped: list[tuple[int, list[int]]] = []
    for slot, index in enumerate(tensor_of_slot):
        if grouped and grouped[-1][0] == index and plan.slots[grouped[-1][1][-1]].file == plan.slots[slot].file:
            grouped[-1][1].append(slot)
        else:
            grouped.append((index, [slot]))
    items = []
    for index, slots in grouped:
        entry = plan.slots[slots[0]].entry
        for rows in row_pieces(entry.shape, entry.nbytes, largest):
            nbytes = entry.nbytes if rows is None else entry.nbytes * (rows[1] - rows[0]) // entry.shape[0]
            items.append(Item(index, tuple(slots), rows, nbytes * len(slots)))
    return items


def _writer_ranks(count: int) -> list[int]:
    """``count`` ranks spread evenly over the world (on several nodes, writers on every node)."""
    world = world_size()
    return [k * world // count for k in range(count)]


def _rounds(items_bytes: list[int], owner: list[int], writers: int, bucket_bytes: int) -> list[list[int]]:
    """Each writer's items (positions) in buckets of at most ``bucket_bytes`` (a larger item alone);
    round k is every writer's k-th bucket, so each writer receives at most one bucket at a time."""
    buckets: list[list[list[int]]] = [[] for _ in range(writers)]
    room = [0] * writers
    for position, (size, writer) in enumerate(zip(items_bytes, owner)):
        if not buckets[writer] or size > room[writer]:
            buckets[writer].append([])
            room[writer] = bucket_bytes
        buckets[writer][-1].append(position)
        room[writer] -= size
    depth = max(len(own) for own in buckets)
    return [[position for own in buckets if number < len(own) for position in own[number]] for number in range(depth)]


def full_state_dict(state: AverageState, average: str | None, live: bool = False) -> dict[str, torch.Tensor]:
    """Collective: on rank 0 ``{name: full tensor}`` on CPU (every name of a tied tensor), ``{}`` elsewhere."""
    result: dict[str, torch.Tensor] = {}
    for info, full in state.gathered(dst=0, average=average, live=live):
        if full is not None:
            full = full.cpu()
            for name in info.names:
                result[name] = full
    return result


def copy_to(state: AverageState, module: nn.Module, average: str | None) -> None:
    """Collective: write ``average`` into the plain ``module`` on every rank, the owners' values."""
    state.average(average)  # a wrong name is refused before anything else
    target = module.state_dict(keep_vars=True)
    expected = {name: info.shape for info in state.infos for name in info.names}
    missing = sorted(set(expected) - set(target))
    unexpected = sorted(set(target) - set(expected))
    misshaped = sorted(
        f"{name}: {tuple(target[name].shape)} vs {tuple(shape)}"
        for name, shape in expected.items()
        if name in target and target[name].shape != shape
    )
    if missing or unexpected or misshaped:
        raise ValueError(
            f"copy_to(): {type(module).__name__} does not match the averaged model: missing {missing}, "
            f"unexpected {unexpected}, mis-shaped {misshaped}"
        )
    with torch.no_grad():
        for info, full in state.gathered(dst=None, average=average):
            for name in info.names:
                target[name].copy_(full)
