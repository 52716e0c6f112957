"""Which rank holds which part of every tensor, and gathering full tensors from those parts.

Every tensor's ``TensorLayout`` (``tensor_layout.py``) comes from its strategy, derived from what
every rank already knows (DTensor placements, a flat partition), so building the layout costs
each rank the same at 8 ranks as at 4,096: ``ShardLayout.build`` checks that each rank's own
part is what its layout says and that the ranks agree on every layout (one all-reduce of a
digest, not every rank's table), and proves once per distinct layout that the owned parts tile
the tensor, which turns a mistake in a strategy into a clear error instead of a wrong export.
Where a rank's part disagrees with its strategy's rule (an engine laid out in a way the strategy
does not know), the parts of those tensors alone are gathered from every rank
(``ListedLayout``), and tiled the same way. Identical parts on several ranks are replicas (DDP,
HSDP, tensor parallel's replicated dims, every buffer); the lowest such rank *owns* the part.

``iter_gathered`` then rebuilds full tensors from the owners' parts with point-to-point
sends, a bounded bucket of tensors at a time: the receiving rank holds at most one bucket
(or one tensor, if larger) beyond what it already had; ``gather_rounds`` also gathers rows of
a tensor, so an export sends a tensor larger than a bucket in pieces. A part that is one range of the
flattened tensor is received in place; any other (columns, strided ranges) is received into a
buffer of its own and its boxes copied into place, so such parts can double what a bucket
holds while they are in flight. This one mechanism serves every engine and layout, for averaged and live values alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..base.dist import all_gathered, comm_device, digest, distributed, rank, same_everywhere
from ..base.errors import LayoutError
from ..layouts.tensor_info import TensorInfo
from .parts import Part, place
from .tensor_layout import ListedLayout, Owned, TensorLayout

DEFAULT_BUCKET_BYTES = 64 * 2**20

Wanted = tuple[int, int | None, tuple[int, int] | None]  # (tensor index, receiving rank, rows or None: all)


def tiling(info: TensorInfo, parts: Sequence[Part]) -> tuple[Owned, ...]:
    """The owned parts of one tensor from every rank's part, checked to tile it."""
    layout = ListedLayout(tuple(info.shape), tuple(parts))
    layout.check(info.name)
    return layout.owned


@dataclass(frozen=True)
class ShardLayout:
    """Every tensor's layout over the ranks, agreed by every rank and checked to tile it."""

    layouts: tuple[TensorLayout, ...]
    gathered: tuple[int, ...]  # the tensors whose parts had to be gathered from every rank

    @classmethod
    def build(cls, infos: Sequence[TensorInfo]) -> ShardLayout:
        """Collective: agree with every rank on the tensors and their layouts, in one all-reduce of
        digests; only where a rank could not derive a layout (or the ranks derived unlike ones)
        are the parts gathered from every rank."""
        me = rank()
        tensors = [(info.name, tuple(info.shape)) for info in infos]
        layouts: list[TensorLayout | None] = [
            info.layout if info.layout is not None and info.layout.part(me) == info.part else None for info in infos
        ]
        undecided = [index for index, layout in enumerate(layouts) if layout is None]
        gathered: list[int] = []
        if not (same_everywhere([*digest(tensors), *digest(_keys(layouts)), len(undecided)]) and not undecided):
            reports = all_gathered((digest(tensors), undecided))  # the rare path: gather what must be
            if len({tuple(names) for names, _ in reports}) > 1:
                _raise_different_tensors(tensors)
            gathered = sorted({index for _, theirs in reports for index in theirs})
            if gathered:
                everyone = all_gathered([infos[index].part for index in gathered])
                for position, index in enumerate(gathered):
                    parts = tuple(theirs[position] for theirs in everyone)
                    layouts[index] = ListedLayout(tuple(infos[index].shape), parts)
            if not gathered or not same_everywhere(digest(_keys(layouts))):  # unlike rules: every part of every tensor
                everyone = all_gathered([info.part for info in infos])
                layouts = [ListedLayout(tuple(i.shape), tuple(p[k] for p in everyone)) for k, i in enumerate(infos)]
                gathered = list(range(len(infos)))
        checked: set[TensorLayout] = set()
        for info, layout in zip(infos, layouts):
            if layout not in checked:  # once per distinct layout
                layout.check(info.name)  # type: ignore[union-attr]
                checked.add(layout)  # type: ignore[arg-type]
        return cls(layouts=tuple(layouts), gathered=tuple(gathered))  # type: ignore[arg-type]

    def part(self, index: int, holder: int) -> Part:
        return self.layouts[index].part(holder)

    def owned(self, index: int) -> tuple[Owned, ...]:
        return self.layouts[index].owned

    def holds_whole(self, index: int, holder: int) -> bool:
        """Whether rank ``holder`` has all of tensor ``index`` locally, in its own order."""
        part = self.part(index, holder)
        return part.flat_range() == (0, int(torch.Size(part.shape).numel()))

    def owns(self, index: int, holder: int) -> bool:
        return self.layouts[index].owner_of(holder) == holder

    def replicas(self, index: int, owner: int) -> list[int]:
        """The other ranks holding the very part ``owner`` owns of tensor ``index``."""
        return self.layouts[index].replicas(owner)


def _keys(layouts: Sequence[TensorLayout | None]) -> list:
    return [None if layout is None else layout.key() for layout in layouts]


def _raise_different_tensors(tensors: list[tuple[str, tuple[int, ...]]]) -> None:
    """Collective (the ranks saw their digests differ): name what differs between this rank and another."""
    me = rank()
    for other, theirs in enumerate(all_gathered(tensors)):
        if theirs != tensors:
            only_mine = sorted({k[0] for k in tensors} - {k[0] for k in theirs})
            only_theirs = sorted({k[0] for k in theirs} - {k[0] for k in tensors})
            reshaped = sorted(a[0] for a, b in zip(tensors, theirs) if a[0] == b[0] and a != b)
            raise LayoutError(
                f"rank {me} and rank {other} track different tensors: only on rank {me}: {only_mine}; "
                f"only on rank {other}: {only_theirs}; other shape: {reshaped}"
            )
    raise LayoutError("the ranks track different tensors")


def _buckets(indices: Sequence[int], nbytes: Callable[[int], int], limit: int) -> Iterator[list[int]]:
    bucket: list[int] = []
    size = 0
    for index in indices:
        if bucket and size + nbytes(index) > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(index)
        size += nbytes(index)
    if bucket:
        yield bucket


def _gather_one(
    layout: ShardLayout, index: int, local: torch.Tensor, dst: int | None, pending: list
) -> torch.Tensor | None:
    """Gather tensor ``index``, flat, on rank ``dst`` (every rank if None); point-to-point sends and
    receives go to ``pending`` as ``(work, buffer, into)``: a part that is not one range of the
    flattened tensor is received whole into ``buffer`` and placed (``into``: the output and the
    part) once its work has completed.

    Every part comes from its owner: a rank holding its own copy of a replicated tensor
    (BatchNorm statistics without SyncBatchNorm) receives the owner's value like the others.
    Every rank takes the same branches: they depend on the shared layout only.
    """
    me = rank()
    if not distributed():  # one process holds everything
        return local.clone()
    if dst is not None and layout.holds_whole(index, dst) and layout.owns(index, dst):
        return local.clone() if me == dst else None
    device = comm_device(local.device)
    shape = layout.layouts[index].shape
    numel = int(torch.Size(shape).numel())
    if dst is None:  # each owner broadcasts its part to all
        out = torch.empty(numel, dtype=local.dtype, device=device)
        for owner, part in layout.owned(index):
            flat = part.flat_range()
            if flat is not None:
                if owner == me:
                    out[flat[0] : flat[1]].copy_(local)
                dist.broadcast(out[flat[0] : flat[1]], src=owner)
            else:
                buffer = local.to(device) if owner == me else torch.empty(part.numel, dtype=local.dtype, device=device)
                dist.broadcast(buffer, src=owner)
                place(out.view(shape), part, buffer)
        return out
    if me != dst:  # a sender looks at its own part only: its cost does not grow with the world
        if layout.owns(index, me):
            buffer = local.to(device)
            pending.append((dist.isend(buffer, dst=dst), buffer, None))
        return None
    out = torch.empty(numel, dtype=local.dtype, device=device)
    for owner, part in layout.owned(index):
        flat = part.flat_range()
        if owner == me:
            place(out.view(shape), part, local)
        elif flat is not None:  # straight into its place
            pending.append((dist.irecv(out[flat[0] : flat[1]], src=owner), out, None))
        else:
            buffer = torch.empty(part.numel, dtype=local.dtype, device=device)
            pending.append((dist.irecv(buffer, src=owner), buffer, (out, part)))
    return out


def _gather_rows(
    layout: ShardLayout, index: int, local: torch.Tensor, dst: int, rows: tuple[int, int], pending: list
) -> torch.Tensor | None:
    """Gather rows ``[start, stop)`` of tensor ``index``, flat, on rank ``dst``: each owner sends
    what its part holds of them (``Part.rows_of``), and ``dst`` places it (``Part.within_rows``);
    owners holding none of them send nothing. Otherwise as ``_gather_one``."""
    me = rank()
    start, stop = rows
    shape = tuple(layout.layouts[index].shape)
    if not distributed() or (layout.holds_whole(index, dst) and layout.owns(index, dst)):
        return local.view(shape)[start:stop].reshape(-1).clone() if me == dst or not distributed() else None
    device = comm_device(local.device)
    if me != dst:
        if layout.owns(index, me):
            held = layout.part(index, me).rows_of(local, start, stop)
            if held.numel():
                buffer = held.to(device)
                pending.append((dist.isend(buffer, dst=dst), buffer, None))
        return None
    rows_shape = (stop - start, *shape[1:])
    out = torch.empty(int(torch.Size(rows_shape).numel()), dtype=local.dtype, device=device)
    for owner, part in layout.owned(index):
        held = part.within_rows(start, stop)
        if not held.numel:
            continue
        flat = held.flat_range()
        if owner == me:
            place(out.view(rows_shape), held, part.rows_of(local, start, stop))
        elif flat is not None:
            pending.append((dist.irecv(out[flat[0] : flat[1]], src=owner), out, None))
        else:
            buffer = torch.empty(held.numel, dtype=local.dtype, device=device)
            pending.append((dist.irecv(buffer, src=owner), buffer, (out, held)))
    return out


def iter_gathered(
    layout: ShardLayout,
    infos: Sequence[TensorInfo],
    local_part: Callable[[int], torch.Tensor],
    indices: Sequence[int],
    *,
    dst: int | None = 0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Collective: yield ``(index, full tensor)`` for each of ``indices``, in order.

    ``local_part(i)`` is this rank's part of tensor ``i`` (flat, contiguous, ``part.numel`` elements); every
    rank passes the same ``indices``. With ``dst`` set only that rank receives tensors (the
    others get ``None``); with ``dst=None`` every rank does. Tensors come back in their
    global shape, on the device of the local parts, never aliasing them.
    """
    nbytes = lambda i: infos[i].numel * infos[i].dtype.itemsize  # noqa: E731
    rounds = ([(index, dst, None) for index in bucket] for bucket in _buckets(indices, nbytes, bucket_bytes))
    for index, _, full in gather_rounds(layout, infos, local_part, rounds):
        yield index, full


def gather_rounds(
    layout: ShardLayout,
    infos: Sequence[TensorInfo],
    local_part: Callable[[int], torch.Tensor],
    rounds: Iterable[Sequence[Wanted]],
) -> Iterator[tuple[int, int | None, torch.Tensor | None]]:
    """Collective: for each round, gather each ``(index, dst, rows)`` of it to rank ``dst`` (every
    rank if ``None``) and yield ``(index, dst, tensor or None)`` in order: the full tensor, or with
    ``rows = (start, stop)`` only those rows of it (``dst`` set), so a tensor larger than a bucket
    travels in pieces. Every rank passes the same rounds. A round's sends and receives are all
    posted, in the same order on every rank, before any is waited for: a round whose tensors go
    to different ranks is one exchange in which each of them receives its own, and a rank holds
    at most one round's tensors."""
    for round_ in rounds:
        pending: list = []
        local = {index: local_part(index) for index, _, _ in round_}
        outputs = [
            _gather_one(layout, index, local[index], dst, pending)
            if rows is None
            else _gather_rows(layout, index, local[index], dst, rows, pending)  # type: ignore[arg-type]
            for index, dst, rows in round_
        ]
        while pending:  # (no loop variable may keep the last buffer alive)
            work, buffer, into = pending.pop()
            work.wait()
            if into is not None:  # a part that is no range of the flattened tensor: its boxes, one by one
                place(into[0].view(into[1].shape), into[1], buffer)
            del work, buffer, into
        outputs.reverse()
        for index, dst, rows in round_:
            out = outputs.pop()  # released here, so at most one round is held at a time
            shape = infos[index].shape if rows is None else (rows[1] - rows[0], *infos[index].shape[1:])
            yield index, dst, None if out is None else out.to(local[index].device).view(shape)
            del out
