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
finished (``model_writer.write_spread``, the driver every model folder is written through). So
W ranks write about 1/W of the model each; the work is split as a merge's is (``work``).

``export`` runs this sequence, every step on every rank unless named (the lead is rank 0; a
writer one of ``writers`` ranks spread over the world: ``_writer_ranks``); a failure at a step is
every rank's there (``Writers.agree``), and leaves the previous export whole:

1) (all ranks) plan the files (``WeightPlan``, the same everywhere) and check that every rank
   planned the same folder and files (``same_everywhere``: one all-reduce of a digest);
   ``refuse_unlike_replicas`` (replicated strategy only).
2) (all ranks) split the work: the parts written where they lie (every rank writing), the rest
   assigned to writers by bytes and cut into rounds of at most a bucket each.
3) (all ranks) ``write_spread`` draws the export's id (one all-reduce); (lead) prepares the
   folder (``staged_export``: checked, locked, the plan's files created under temporary names).
4) (all ranks) write the parts held where they lie (``_write_held``), and take part in every
   round of the gather (``state.gathered_to``); (writers) write what they receive at its offsets
   (``_write_received``), each file proved to be this export's through the descriptor written with.
5) (lead) once every writer has finished, ``weight_files.commit``: renames only, every weight
   file into place, then the index, then the record. (all ranks) agree on the commit.

``full_state_dict`` and ``copy_to`` gather the same way (``state.gathered_to``), to rank 0 or to
every rank, and write no file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from ..base.dist import digest, rank, same_everywhere, world_size
from ..base.dtypes import dtype_name
from ..base.errors import ExportError
from ..checkpoints.description import Description
from ..output.model_writer import cast, export_entries, parse_size, write_spread
from ..output.provenance import made_by
from ..output.record import FolderRecord
from ..output.target import out_path
from ..output.weight_files import Slot, Slots, WeightPlan
from ..output.work import Work, Writers, assign, pieces
from ..output.write_options import WriteOptions
from .average_state import AverageState
from .checkpoint import refuse_unlike_replicas


def export(
    state: AverageState,
    path: str | os.PathLike,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    average: str | None,
    live: bool,
    writers: int | None,
) -> Path:
    """Collective: gather ``average`` (or the live weights) and write it as a model folder, its bytes
    spread over ``writers`` ranks (default: every rank; ``1``: rank 0 alone, for a file system
    that cannot take concurrent writers), the same files whatever the number. The write options
    come as ``avg.export`` took them (``write_options``: their defaults and checks)."""
    options = WriteOptions(max_shard_size=max_shard_size, dtype=dtype, writers=writers)
    max_bytes = parse_size(options.max_shard_size)
    path = out_path(path, "export")
    name = None if live else state.average(average).name
    ranks = _writer_ranks(world_size() if writers is None else min(writers, world_size()))
    local = (state.flat_part(i, name, live) for i in range(len(state.infos)))
    entries = export_entries(
        ((info.names, part.dtype, tuple(info.shape)) for info, part in zip(state.infos, local)), dtype
    )
    plan = WeightPlan(entries, max_bytes, _record(state.describe(), name, live, dtype, len(ranks)))
    if not same_everywhere(digest((str(path.resolve()), writers or 0, plan.sizes))):
        raise ExportError(
            f"exporting to {path}: the ranks name different folders or writers, or planned different files: every "
            "rank passes the same arguments, and the folder is on a file system every rank sees"
        )
    refuse_unlike_replicas(state, f"exporting to {path}", [name], live)  # (before anything is written)
    held = [] if writers is not None else _held_in_ranges(state)  # (every rank writing: each its own parts)
    largest = min(state.gather_bucket_bytes, max(1, plan.total_bytes // len(ranks)))
    written_held = frozenset(held)
    items = [item for item in work_of(_slot_tensors(state), plan, largest) if item.index not in written_held]
    owner = assign([item.nbytes for item in items], len(ranks))
    rounds = _rounds([item.nbytes for item in items], owner, len(ranks), state.gather_bucket_bytes)
    order = [items[position] for round_ in rounds for position in round_]
    wanted = [[(items[at].index, ranks[owner[at]], items[at].rows) for at in round_] for round_ in rounds]
    gathered = state.gathered_to(wanted, name, live)  # checks the averager before anything is written
    own = _written_where_held(state, held)
    slots_of: dict[int, list[Slot]] = {}
    for slot, index in zip(plan.slots, _slot_tensors(state)):
        slots_of.setdefault(index, []).append(slot)

    def write(slots: Slots) -> Exception | None:
        error = _write_held(state, own, name, live, slots, slots_of, dtype)
        return _write_received(gathered, iter(order), slots, plan, dtype, state, error)

    return write_spread(path, plan, write, f"exporting to {path}", Writers.of(True, ExportError))


def _record(
    description: Description, average: str | None, live: bool, dtype: torch.dtype | None, writers: int
) -> FolderRecord:
    """The record of an averager's export: which average (or the live weights) after how many
    steps and updates, from which engine, written by how many ranks."""
    made = made_by(
        "export", world_size(), average="live weights" if live else average, step=description.step,
        num_updates=description.num_updates, run_id=description.run, strategy=description.strategy,
        dtype=None if dtype is None else dtype_name(dtype), writers=writers,
    )  # fmt: skip
    return FolderRecord.of_average(description, average, live, made)


def _slot_tensors(state: AverageState) -> list[int]:
    """Each slot's tensor: the averager's tensors, each under every one of its names, in order."""
    return [index for index, info in enumerate(state.infos) for _ in info.names]


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
    items: Iterator[Work],
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


def work_of(tensor_of_slot: list[int], plan: WeightPlan, largest: int) -> list[Work]:
    """What is gathered, in the files' order: each tensor (``pieces``), its names that follow each
    other in one file written together."""
    grouped: list[tuple[int, list[int]]] = []
    for slot, index in enumerate(tensor_of_slot):
        if grouped and grouped[-1][0] == index and plan.slots[grouped[-1][1][-1]].file == plan.slots[slot].file:
            grouped[-1][1].append(slot)
        else:
            grouped.append((index, [slot]))
    items = []
    for index, slots in grouped:
        entry = plan.slots[slots[0]].entry
        items += pieces(index, entry.shape, entry.nbytes * len(slots), tuple(slots), largest)
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
    refuse_unlike_replicas(state, "full_state_dict()", [None if live else state.average(average).name], live)
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
    refuse_unlike_replicas(state, "copy_to()", [state.average(average).name])
    with torch.no_grad():
        for info, full in state.gathered(dst=None, average=average):
            for name in info.names:
                target[name].copy_(full)
