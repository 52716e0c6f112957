"""The update's kernels: shadows and local shards grouped so that an update reads each byte once.

A group holds tensors that one call can update together: the same role (averaged or copied),
shadow device and dtype, and live dtype and device. It holds one list of shadows per average
kept (copied tensors have one, shared by all), so each local shard is read, screened and staged
once per update however many averages take it in. Within a group, neighbours that lie back to
back in memory on both sides (FSDP1's flat shard, ZeRO-3's flattened partitions, against
shadows carved from one pool) are fused into one flat view, so the kernels run over a few large
tensors instead of one small tensor per parameter; the elementwise results are the same bits.

The update walks each group's ``Batch``es. A batch either reads the local shards where they are
(one ``_foreach_lerp_`` over the fused views: live and shadow of one dtype) or first copies
them into a small reusable buffer and lerps from there while the copy is still in cache:

- bf16 or fp16 weights into an fp32 average: ``lerp`` refuses mixed dtypes, and a ``mul_`` then
  an ``add_`` read and write the shadow twice; a cast of a 128K-element piece into the buffer
  and a ``lerp_`` from it move the bytes of one pass (the local shard read once, the shadow read
  and written once) and give the bits of ``lerp_(shadow, live.float(), weight)``;
- small shards that lie apart (an FSDP2 bias, a LayerNorm weight: one tensor per parameter,
  where a kernel's launch costs more than its work) are gathered by one copy, and each sequence
  of them whose shadows lie back to back is lerped as one flat view.

On CUDA, where the Triton kernel of ``kernels.py`` runs, a group casts inside that kernel
instead (``UpdateGroup.kernel``), which also skips the update on a device-side flag when the
non-finite check stays on the device. The non-finite screen (``nonfinite``) reads each live
byte once more: a sum per large piece and one ``_foreach_norm`` over the small shards, one flag
per group on the host. Nothing here loops over parameters in Python except where a bounded
staging copy is unavoidable (shadows on another device than the local shards, or a custom rule
that needs the shadow dtype).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..rules import MultiAvgFn
from . import kernels
from .options import Role
from .staging import Stager

# Fused views are cut into pieces of at most this many elements: on CPU a bf16 sum or norm over
# one huge tensor runs 4-6x slower than over 1M-element pieces (measured). Several averages lerp
# in these pieces too, each piece read by all while it is still in cache.
FUSED_PIECE = 2**20
# One average lerps its fused views (same dtype, no kernel) in pieces of up to this many elements:
# each piece is a call with its own dispatch and threads' join, and on a 2-core Xeon the fp32 update
# of FSDP1's and DDP's 50M-parameter transformer ran 1.5-2% slower in 1M-element pieces than in
# 16M-element ones (FSDP1's whole views were no faster than 16M).
LERP_PIECE = 2**24
# A cast is staged in pieces of this many elements, up to STAGED_ELEMENTS per batch: on a 2-core
# EPYC a bf16-to-fp32 cast and lerp ran fastest at 128K x 8 (5.9 ms for 12.6M elements, where a
# mul_ then an add_ took 7.3-19 ms and a lerp of fp32 weights 4.2 ms).
CAST_PIECE, STAGED_ELEMENTS = 2**17, 2**20
# A launch of the Triton kernel walks up to this many elements (a launch costs more than a CPU call).
KERNEL_PIECE = 2**28
# With several averages, the fused pieces are walked in batches of about this many live bytes, so
# each piece is still in cache when the next average reads it.
CACHE_BYTES = 4 * 2**20
# A shard of at most this many elements that lies apart in memory is gathered, when its group has
# at least GATHER_MIN of them, up to GATHER_BYTES of staging per group.
GATHER_NUMEL, GATHER_MIN, GATHER_BYTES = 4096, 8, 16 * 2**20
# The screen reads a piece of at least this many elements alone; smaller ones are copied by one
# ``cat`` into a scratch of SCREENED_ELEMENTS, read there while in cache (a per-tensor reduction
# costs ~4 us a tensor on a CPU: 170 ms over an MoE rank's 44,000 expert shards; a cat, 0.15).
SUMMED_NUMEL, SCREENED_ELEMENTS = 2**16, 2**18
data_ptr = torch.Tensor.data_ptr


@dataclass
class Gathered:
    """A group's small shards that lie apart in memory, copied at each update into one staging
    buffer of their dtype, so that the screen and the update read them as one tensor: their
    shadows lie back to back in every average (``AverageState`` carves them so)."""

    positions: list[int]  # in the group's lists
    flat_live: list[torch.Tensor]  # each gathered local shard, flattened (a view of its data)
    staging: torch.Tensor  # flat, the live dtype
    shadows: list[torch.Tensor]  # per average: its shadows of these shards as one flat view

    def stage(self) -> None:
        # (one ``cat``: a tight copy loop, 3x faster than ``_foreach_copy_`` over 900 small shards)
        torch.cat(self.flat_live, out=self.staging)


@dataclass
class Batch:
    """Live tensors an update reads together, and the pairs it lerps.

    ``live`` is read where it is (``staged`` empty: then ``reads`` is ``live``) or copied first
    into ``staged``, views of the group's buffer, cast to the shadows' dtype on the way; ``reads``
    are then flat views of that buffer, one per sequence of shadows that lie back to back, and
    ``shadows[k]`` the matching views of average ``k``'s shadows."""

    live: list[torch.Tensor]
    staged: list[torch.Tensor]
    reads: list[torch.Tensor]
    shadows: list[list[torch.Tensor]]
    plan: kernels.Plan | None = None  # the kernel's tables over the flat reads, built at its first launch
    strided: list[int] = field(default_factory=list)  # positions of the other reads (whole strided shards: ATen)

    def stage(self) -> None:
        if self.staged:
            torch._foreach_copy_(self.staged, self.live)

    def kernel_plan(self) -> kernels.Plan:
        """One launch's tables for every flat read of the batch (they hold addresses: the batch is
        rebuilt, and its plan with it, whenever a local shard moves)."""
        if self.plan is None:
            flat = [p for p, read in enumerate(self.reads) if read.dim() == 1 and read.is_contiguous()]
            self.strided = [p for p in range(len(self.reads)) if p not in flat]
            self.plan = kernels.plan([self.reads[p] for p in flat], [[s[p] for p in flat] for s in self.shadows])
        return self.plan


@dataclass
class Screen:
    """What the non-finite screen reads of a group's local shards, planned once: the large pieces
    where they are, the small ones in buckets copied into a scratch, the strided ones as they are."""

    large: list[torch.Tensor]
    buckets: list[tuple[list[torch.Tensor], torch.Tensor]]  # (small pieces, flat; the scratch they fill)
    strided: list[torch.Tensor]

    @classmethod
    def of(cls, pieces: Sequence[torch.Tensor]) -> Screen:
        large = [piece for piece in pieces if piece.numel() >= SUMMED_NUMEL]
        strided = [p for p in pieces if 0 < p.numel() < SUMMED_NUMEL and not p.is_contiguous()]
        small = [p.view(-1) for p in pieces if 0 < p.numel() < SUMMED_NUMEL and p.is_contiguous()]
        buckets: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        if small:
            size = max(min(SCREENED_ELEMENTS, sum(p.numel() for p in small)), max(p.numel() for p in small))
            scratch = torch.empty(size, dtype=small[0].dtype, device=small[0].device)
            bucket: list[torch.Tensor] = []
            filled = 0
            for piece in small:
                if bucket and filled + piece.numel() > scratch.numel():
                    buckets.append((bucket, scratch[:filled]))
                    bucket, filled = [], 0
                bucket.append(piece)
                filled += piece.numel()
            buckets.append((bucket, scratch[:filled]))
        return cls(large, buckets, strided)

    def values(self) -> list[torch.Tensor]:
        """Values that are non-finite when the pieces hold NaN or infinity (and, rarely, when a
        finite sum or product overflows)."""
        values = [value for piece in self.large for value in _screened(piece)]
        for bucket, scratch in self.buckets:
            torch.cat(bucket, out=scratch)
            values.extend(_screened(scratch))
        return values + (list(torch._foreach_norm(self.strided, 2)) if self.strided else [])


@dataclass
class UpdateGroup:
    role: Role
    indices: list[int] = field(default_factory=list)
    shadows: list[list[torch.Tensor]] = field(default_factory=list)  # one list per average (one if copied)
    live_tensors: list[torch.Tensor] = field(default_factory=list)
    # the same elements, neighbours in memory merged into one flat view (see ``fuse``)
    fused_shadows: list[list[torch.Tensor]] = field(default_factory=list)
    fused_live: list[torch.Tensor] = field(default_factory=list)
    live_pointers: list[int] = field(default_factory=list)  # where each local shard's data was
    # What the update walks when the shadows lie on the local shards' device (see ``Batch``): the
    # gathered small shards, the batches, and what the non-finite screen reads
    gathered: Gathered | None = None
    batches: list[Batch] = field(default_factory=list)
    screen: Screen | None = None
    kernel: bool = False  # the update runs in ``kernels.masked_update_`` (CUDA), which casts as it goes


def group_tensors(
    roles: Sequence[Role],
    shadow_sets: Sequence[Sequence[torch.Tensor | None]],
    live_tensors: Sequence[torch.Tensor],
    kernel_devices: frozenset[str] = frozenset({"cuda"}),
) -> list[UpdateGroup]:
    """Group the stored tensors; ``shadow_sets`` holds one list of shadows per average.

    Groups of floating-point tensors whose local shards and shadows lie on a device type in
    ``kernel_devices`` are updated by the Triton kernel when it runs there (``kernels.usable``:
    its first call for a device checks the kernel's bits there, and ``SHARDAVG_KERNEL=0`` says no)."""
    groups: dict[tuple, UpdateGroup] = {}
    for index, (role, live) in enumerate(zip(roles, live_tensors)):
        shadow = shadow_sets[0][index]
        if shadow is None:
            continue
        key = (role, shadow.device, shadow.dtype, live.dtype, live.device)
        group = groups.setdefault(
            key, UpdateGroup(role, shadows=[[] for _ in shadow_sets[: _set_count(role, shadow_sets)]])
        )
        group.indices.append(index)
        for shadows, shadow_set in zip(group.shadows, shadow_sets):
            shadows.append(shadow_set[index])
        group.live_tensors.append(live)
    for group in groups.values():
        group.fused_shadows, group.fused_live = fuse(group.shadows, group.live_tensors)
        group.live_pointers = list(map(data_ptr, group.live_tensors))
        live, shadow = group.live_tensors[0], group.shadows[0][0]
        if live.device == shadow.device:
            group.kernel = (
                live.device.type in kernel_devices
                and live.dtype in kernels.DTYPES
                and shadow.dtype in kernels.DTYPES
                and kernels.usable(live.device)
            )
            group.batches = _batches(group)
        else:
            group.screen = Screen.of(group.fused_live)
    return list(groups.values())


def _batches(group: UpdateGroup) -> list[Batch]:
    """How the update walks ``group`` (its shadows on its local shards' device), see ``Batch``;
    sets ``group.gathered`` and ``group.screen`` on the way."""
    live, shadow = group.live_tensors[0], group.shadows[0][0]
    group.gathered = _gather(group)
    gathered = [] if group.gathered is None else group.gathered.positions
    rest = sorted(set(range(len(group.live_tensors))) - set(gathered))
    rest_shadows, rest_live = [[s[p] for p in rest] for s in group.shadows], [group.live_tensors[p] for p in rest]
    cast = live.dtype != shadow.dtype and not group.kernel
    if cast:
        piece_numel = CAST_PIECE
    elif group.kernel:
        piece_numel = KERNEL_PIECE
    else:
        piece_numel = FUSED_PIECE if len(group.shadows) > 1 else LERP_PIECE
    shadow_sets, pieces = fuse(rest_shadows, rest_live, piece_numel)
    screened = list(pieces) if piece_numel == FUSED_PIECE else fuse(rest_shadows, rest_live)[1]
    if group.gathered is not None:
        staging = group.gathered.staging
        screened.append(staging)
        pieces += staging.split(piece_numel)
        for pieces_k, gathered_k in zip(shadow_sets, group.gathered.shadows):
            pieces_k += gathered_k.split(piece_numel)
    group.screen = Screen.of(screened)
    if cast:  # every piece cast through the buffer
        return _staged_batches(pieces, shadow_sets, shadow.dtype)
    batch = max(1, len(pieces))
    if len(group.shadows) > 1 and pieces and not group.kernel:  # several averages read each piece while in cache
        batch = max(1, CACHE_BYTES // pieces[0].nbytes)
    bounds = [(start, start + batch) for start in range(0, len(pieces), batch)]
    return [Batch(pieces[a:b], [], pieces[a:b], [s[a:b] for s in shadow_sets]) for a, b in bounds]


def _staged_batches(
    pieces: list[torch.Tensor], shadow_sets: list[list[torch.Tensor]], dtype: torch.dtype
) -> list[Batch]:
    """Batches of at most ``STAGED_ELEMENTS`` staged elements (or one larger piece) through one
    buffer of ``dtype``: each piece copied into it, each sequence of pieces whose shadows lie back
    to back in every average lerped as one flat view."""
    if not pieces:
        return []
    largest = max(piece.numel() for piece in pieces)
    buffer = torch.empty(max(min(STAGED_ELEMENTS, sum(p.numel() for p in pieces)), largest), dtype=dtype,
                         device=pieces[0].device)  # fmt: skip
    batches: list[Batch] = []
    start, filled = 0, 0
    for stop in range(1, len(pieces) + 1):
        filled += pieces[stop - 1].numel()
        if stop < len(pieces) and filled + pieces[stop].numel() <= buffer.numel():
            continue
        batches.append(_staged_batch(pieces[start:stop], [s[start:stop] for s in shadow_sets], buffer))
        start, filled = stop, 0
    return batches


def _staged_batch(pieces: list[torch.Tensor], shadow_sets: list[list[torch.Tensor]], buffer: torch.Tensor) -> Batch:
    staged, offset = [], 0
    for piece in pieces:
        staged.append(buffer[offset : offset + piece.numel()].view(piece.shape))
        offset += piece.numel()
    reads: list[torch.Tensor] = []
    views: list[list[torch.Tensor]] = [[] for _ in shadow_sets]
    start = 0
    for stop in range(1, len(pieces) + 1):
        flat = staged[stop - 1].dim() == 1 and stop < len(pieces) and staged[stop].dim() == 1
        if flat and all(_adjacent(s[stop - 1], s[stop]) for s in shadow_sets):
            continue
        if stop - start == 1:
            reads.append(staged[start])
            for views_k, shadows in zip(views, shadow_sets):
                views_k.append(shadows[start])
        else:
            length = sum(p.numel() for p in pieces[start:stop])
            first = staged[start].data_ptr() - buffer.data_ptr()
            reads.append(buffer[first // buffer.itemsize :][:length])
            for views_k, shadows in zip(views, shadow_sets):
                views_k.append(shadows[start].detach().as_strided((length,), (1,)))
        start = stop
    return Batch(pieces, staged, reads, views)


def gatherable(live_tensors: Sequence[torch.Tensor]) -> list[int]:
    """Positions of the small shards that lie apart from their neighbours in memory: the ones
    worth gathering (their shadows are then carved back to back)."""
    return [
        p
        for p, live in enumerate(live_tensors)
        if 0 < live.numel() <= GATHER_NUMEL
        and live.is_contiguous()
        and not (p > 0 and _adjacent(live_tensors[p - 1], live))
        and not (p + 1 < len(live_tensors) and _adjacent(live, live_tensors[p + 1]))
    ]


def _gather(group: UpdateGroup) -> Gathered | None:
    """The group's gatherable shards, when there are enough and their shadows lie back to back
    in every average (``AverageState`` carves them so); else None."""
    live_tensors, positions, size = group.live_tensors, [], 0
    for position in gatherable(live_tensors):
        size += live_tensors[position].nbytes
        if size > GATHER_BYTES:
            break
        positions.append(position)
    if len(positions) < GATHER_MIN:
        return None
    for shadows in group.shadows:
        members = [shadows[p] for p in positions]
        if not all(map(_adjacent, members, members[1:])):
            return None
    members = [live_tensors[p].detach().view(-1) for p in positions]
    staging = torch.empty(sum(live.numel() for live in members), dtype=members[0].dtype, device=members[0].device)
    shadows = [s[positions[0]].detach().as_strided(staging.shape, (1,)) for s in group.shadows]
    return Gathered(positions, members, staging, shadows)


def stage_gathered(groups: Sequence[UpdateGroup]) -> None:
    """Copy every group's gathered small shards into its staging buffer: what the screen and the
    update read of them."""
    for group in groups:
        if group.gathered is not None:
            group.gathered.stage()


def _set_count(role: Role, shadow_sets: Sequence[Sequence]) -> int:
    """Copied tensors have one shadow, shared by every average: it is written once."""
    return len(shadow_sets) if role == "average" else 1


def fuse(
    shadow_sets: Sequence[Sequence[torch.Tensor]],
    live_tensors: Sequence[torch.Tensor],
    piece_numel: int = FUSED_PIECE,
) -> tuple[list, list]:
    """Merge each sequence of tensors that are back to back in memory on every side (the local shards
    and each average's shadows) into one flat view, cut into pieces of ``piece_numel`` elements (empty
    shards, which have no place in memory, are left out: there is nothing to update)."""
    kept = [position for position, live in enumerate(live_tensors) if live.numel()]
    live_tensors = [live_tensors[p] for p in kept]
    shadow_sets = [[shadows[p] for p in kept] for shadows in shadow_sets]
    fused_sets: list[list[torch.Tensor]] = [[] for _ in shadow_sets]
    fused_live: list[torch.Tensor] = []
    start = 0
    for stop in range(1, len(live_tensors) + 1):
        if (
            stop < len(live_tensors)
            and _adjacent(live_tensors[stop - 1], live_tensors[stop])
            and all(_adjacent(shadows[stop - 1], shadows[stop]) for shadows in shadow_sets)
        ):
            continue
        if live_tensors[start].is_contiguous() and all(shadows[start].is_contiguous() for shadows in shadow_sets):
            fused_live.extend(_pieces(live_tensors[start:stop], piece_numel))
            for fused, shadows in zip(fused_sets, shadow_sets):
                fused.extend(_pieces(shadows[start:stop], piece_numel))
        else:  # a strided local shard (adjacency needs dense ones, so it is alone): as it is
            fused_live.append(live_tensors[start])
            for fused, shadows in zip(fused_sets, shadow_sets):
                fused.append(shadows[start])
        start = stop
    return fused_sets, fused_live


def _adjacent(first: torch.Tensor, second: torch.Tensor) -> bool:
    """``second`` starts where ``first`` ends, in the same storage, both dense."""
    return (
        first.is_contiguous()
        and second.is_contiguous()
        and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        and first.data_ptr() + first.nbytes == second.data_ptr()
    )


def _pieces(tensors: Sequence[torch.Tensor], piece_numel: int) -> list[torch.Tensor]:
    """Flat views of at most ``piece_numel`` elements over adjacent dense tensors."""
    fused_view = tensors[0].detach().as_strided((sum(t.numel() for t in tensors),), (1,))
    return list(fused_view.split(piece_numel))


def groups_current(groups: Sequence[UpdateGroup]) -> bool:
    """Whether every local shard's data is still where its group (and its fused views) found it.

    A cast or a move (``model.to(...)``), or ``param.data = other``, gives a tensor new data
    while the object stays the same: its pointer tells, at C speed per tensor."""
    return all(list(map(data_ptr, group.live_tensors)) == group.live_pointers for group in groups)


def nonfinite(groups: Sequence[UpdateGroup]) -> list[int]:
    """Indices of local shards holding NaN or infinity (the gathered ones read where
    ``stage_gathered`` left them).

    A screen reads every live byte once (``Screen``); one flag per group is read on the host. A
    finite sum or product can still overflow, so a positive screen is only followed by the exact
    per-tensor check, which alone names shards.
    """
    flagged = []
    for group in groups:
        if group.screen is not None and group.live_tensors[0].dtype.is_floating_point:
            values = group.screen.values()
            if values and not bool(torch.stack(values).isfinite().all()):
                flagged.append(group)
    return [
        index
        for group in flagged
        for index, live in zip(group.indices, group.live_tensors)
        if not bool(torch.isfinite(live).all())
    ]


def _screened(piece: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One read of ``piece``: for fp32 and fp64 the dot product of its two halves where it splits
    in two (two streams: 10% faster than a sum on a 2-core EPYC; NaN and infinities propagate
    through both), else its sum; fp16 takes its min and max, as its sums and products overflow.
    Never a bf16 dot: ATen's CPU kernel for it is scalar, 340x a bf16 sum's time (42 ms against
    0.12 ms over 1M elements on a 2-core Xeon with AVX512-BF16 and AMX), and the screen was 4x the
    unchecked update on the EPYC (AVX512-BF16) of docs/benchmarks.md."""
    if piece.dtype == torch.float16:
        return torch.aminmax(piece)
    half = piece.numel() // 2
    if piece.dtype in (torch.float32, torch.float64) and piece.dim() == 1 and piece.numel() % 2 == 0:
        return (torch.dot(piece[:half], piece[half:]),)
    return (piece.sum(),)


# What one average does in an update: copy the live values (``None``), lerp toward them by a
# weight, or call a custom rule's ``multi_avg_fn`` with ``num_updates`` as a device tensor.
Step = float | None | tuple[MultiAvgFn, torch.Tensor]


def apply(group: UpdateGroup, steps: Sequence[Step], stager: Stager, gathered_staged: bool = False) -> None:
    """Apply each average's step to its shadows in ``group``, staging each local shard once for all
    (the gathered ones already, with ``gathered_staged``, by ``stage_gathered``).

    A custom rule sees local shards cast to the shadow dtype, one tensor per parameter shard as
    AveragedModel would show them (never fused: the function may look at shapes)."""
    custom = any(isinstance(step, tuple) for step in steps)
    if not custom and group.batches and not needs_staging(group, None):
        if group.gathered is not None and not gathered_staged:
            group.gathered.stage()
        if group.kernel and group.live_tensors[0].dtype != group.shadows[0][0].dtype:  # the kernel casts as it reads
            weights = [None if step is None else _on(group, step) for step in steps]
            apply_masked(group, _on(group, True), weights, stager, gathered_staged=True)
            return
        for batch in group.batches:
            batch.stage()
            for shadows, step in zip(batch.shadows, steps):
                if step is None:
                    torch._foreach_copy_(shadows, batch.reads)
                else:  # bitwise as AveragedModel's EMA (of the live weights cast to the shadows' dtype)
                    torch._foreach_lerp_(shadows, batch.reads, step)
        return
    dtype = group.shadows[0][0].dtype if custom else None
    for shadow_sets, live_tensors in staged(group, dtype, stager, fused=not custom):
        for shadows, step in zip(shadow_sets, steps):
            if step is None:
                torch._foreach_copy_(shadows, live_tensors)
            elif isinstance(step, tuple):
                step[0](shadows, live_tensors, step[1])
            elif live_tensors[0].dtype == shadows[0].dtype:
                torch._foreach_lerp_(shadows, live_tensors, step)
            else:  # shadows offloaded: staged in the live dtype (half the bytes to move), cast here
                _lerp_cast(shadows, live_tensors, step)


def _lerp_cast(shadows: Sequence[torch.Tensor], live_tensors: Sequence[torch.Tensor], weight: float) -> None:
    """``lerp_(shadow, live.to(shadow.dtype), weight)`` for each pair, cast piece by piece through a
    small scratch: the bits of the update beside the local shards, with no scratch their size."""
    scratch = torch.empty(CAST_PIECE, dtype=shadows[0].dtype, device=shadows[0].device)
    for shadow, live in zip(shadows, live_tensors):
        if not live.is_contiguous():
            shadow.lerp_(live.to(shadow.dtype), weight)  # (a strided shard, whole: rare)
            continue
        for shadow_piece, live_piece in zip(shadow.view(-1).split(CAST_PIECE), live.view(-1).split(CAST_PIECE)):
            cast = scratch[: live_piece.numel()]
            cast.copy_(live_piece)
            shadow_piece.lerp_(cast, weight)


def _on(group: UpdateGroup, value: float | bool) -> torch.Tensor:
    """``value`` as a one-element tensor on the group's device, for the kernel to read."""
    dtype = torch.bool if isinstance(value, bool) else torch.float32
    return torch.full((1,), value, dtype=dtype, device=group.live_tensors[0].device)


class Verdict(NamedTuple):
    """Which local shards held NaN or infinity, on the host once ``event`` (if any) has completed
    (the updater keeps the loop's own verdict the same way: no index, one flag, see ``to_host``)."""

    indices: list[int]
    bad: torch.Tensor  # bool per shard in ``indices``, on the host
    event: torch.Event | None  # recorded after the copy to the host; None when nothing was copied


def to_host(bad: torch.Tensor, indices: list[int]) -> Verdict:
    """Device flags ``bad`` (1-d bool) on their way to the host with no wait: on the CPU the flags
    themselves; elsewhere copied into pinned host memory, read once the event says it landed."""
    if bad.device.type == "cpu":
        return Verdict(indices, bad, None)
    event = torch.Event(device=bad.device)
    host = bad.to("cpu", non_blocking=True)
    event.record()
    return Verdict(indices, host, event)


def screen_on_device(groups: Sequence[UpdateGroup]) -> tuple[list[Verdict], dict[torch.device, torch.Tensor]]:
    """The non-finite screen with no host read: per device, a ``Verdict`` copied to the host behind
    an event, and ``ok[device]``, a 0-d device flag that no local shard there is non-finite. An
    infinity-norm per shard (its largest magnitude) never overflows: a finite shard is never flagged."""
    indices: dict[torch.device, list[int]] = {}
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for group in groups:
        shards = [(index, live) for index, live in zip(group.indices, group.live_tensors) if live.numel()]
        if not shards or not group.live_tensors[0].dtype.is_floating_point:
            continue
        accumulate = torch.promote_types(group.live_tensors[0].dtype, torch.float32)
        norms = torch._foreach_norm([live for _, live in shards], float("inf"), dtype=accumulate)
        device = group.live_tensors[0].device
        indices.setdefault(device, []).extend(index for index, _ in shards)
        flags.setdefault(device, []).append(~torch.stack(norms).isfinite())
    verdicts, oks = [], {}
    for device, device_flags in flags.items():
        bad = torch.cat(device_flags)
        oks[device] = ~bad.any()
        verdicts.append(to_host(bad, indices[device]))
    return verdicts, oks


def apply_masked(
    group: UpdateGroup,
    ok: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    stager: Stager,
    gathered_staged: bool = False,
) -> None:
    """The update made conditional on the device: each average lerps toward the local shards with
    its weight as a one-element device tensor (``None``: copies them) where the device flag
    ``ok`` is true, and no shadow changes where it is false.

    The kernel (``group.kernel``) does it in one pass over each batch. Elsewhere (a device where
    Triton does not run, shadows offloaded, integer buffers) each bounded piece takes two ATen
    kernels and a scratch: a lerp toward ``where(ok, live, shadow)``.

    A kernel that fails to compile or launch (``kernels.KernelFailed``: warned once, off on that
    device from then on) never fails the update: what it left undone is finished through ATen
    (``_finish_failed``), and the group is walked as ATen walks it from the next update on."""
    if group.kernel and not needs_staging(group, None):
        if group.gathered is not None and not gathered_staged:
            group.gathered.stage()
        failed = False
        for batch in group.batches:
            batch.stage()
            planned = batch.kernel_plan()
            try:
                kernels.masked_update_many_(planned, weights, ok)  # one launch for every piece
            except kernels.KernelFailed as failure:
                _finish_failed(planned, weights, ok, failure.done)
                failed = True
            for position in batch.strided:  # (a strided local shard, whole: rare)
                _masked_lerp([shadows[position] for shadows in batch.shadows], batch.reads[position], weights, ok)
        if failed:
            group.kernel = False
            group.batches = _batches(group)  # (its screen and gathered shards too, the same objects' parts)
        return
    for shadow_sets, live_tensors in staged(group, None, stager):
        for position, live in enumerate(live_tensors):
            _masked_lerp([shadows[position] for shadows in shadow_sets], live, weights, ok)


def _finish_failed(plan: kernels.Plan, weights: Sequence[torch.Tensor | None], ok: torch.Tensor, done: int) -> None:
    """What a failed kernel left undone: averages ``done`` and later of ``plan``'s pieces (the
    earlier ones its launches wrote; a failed compile or launch writes nothing), where ``ok`` holds,
    with the bits of the ATen path (``apply`` on a group built without the kernel): a lerp toward
    the live values cast to the shadow's dtype, by the weight as a Python float (the fp32 value
    the device holds, which ATen takes as it is). The host reads ``ok`` and the weights here: once
    per group, at the failure (the kernel is off there from then on)."""
    if done == len(weights) or not plan.reads or not bool(ok):
        return
    reads = list(plan.reads)
    for shadows, weight in zip(plan.shadow_sets[done:], weights[done:]):
        if weight is None:
            torch._foreach_copy_(list(shadows), reads)
        elif shadows[0].dtype == reads[0].dtype:
            torch._foreach_lerp_(list(shadows), reads, weight.item())
        else:
            _lerp_cast(shadows, reads, weight.item())


def _masked_lerp(
    shadows: Sequence[torch.Tensor], live: torch.Tensor, weights: Sequence[torch.Tensor | None], ok: torch.Tensor
) -> None:
    """The masked update in ATen: each shadow lerps toward ``where(ok, live.to(shadow.dtype), shadow)``
    (where ``ok`` is false, toward itself: no bit changes), bitwise the host path's update (``apply``)
    for every live and shadow dtype.

    Two things make that so. The live values are cast to the shadow's dtype first, as ``apply``
    stages them (an fp32 local shard into a bf16 average is rounded to bf16, then lerped), never
    promoted with it. And the weight (a device tensor in ``weights``' dtype, at least fp32: see
    ``Updater._weight``) is never rounded to a bf16 or fp16 shadow's dtype: ATen's lerp of such a
    shadow by the Python float ``apply`` passes runs in fp32 (its opmath: both ends widened
    exactly, the weight taken as fp32, the result rounded once to nearest even), while its lerp by
    a tensor weight wants the weight in the shadow's own dtype, which would round it. So a reduced
    precision shadow is lerped in the weight's dtype, as those widened copies, and rounded back:
    the same arithmetic, with the weight never read on the host. (The scratch: a few copies of one
    bounded piece, in the weight's dtype.)"""
    for shadow, weight in zip(shadows, weights):
        masked = torch.where(ok, live.to(shadow.dtype), shadow)
        if weight is None:
            shadow.copy_(masked)
        elif weight.dtype == shadow.dtype:
            shadow.lerp_(masked, weight)
        else:
            shadow.copy_(torch.lerp(shadow.to(weight.dtype), masked.to(weight.dtype), weight))


def needs_staging(group: UpdateGroup, dtype: torch.dtype | None) -> bool:
    """Whether the local shards must be copied before the update: to the shadows' device, or to ``dtype``."""
    return group.live_tensors[0].device != group.shadows[0][0].device or dtype not in (
        None,
        group.live_tensors[0].dtype,
    )


def staged(
    group: UpdateGroup, dtype: torch.dtype | None, stager: Stager, fused: bool = True
) -> Iterator[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]:
    """(shadows per average, live_tensors) with the live_tensors on the shadows' device (and ``dtype``), in
    bounded buckets (``staging.py``), each staged once for every average. When nothing needs
    staging: the fused views (in cache-sized batches when several averages read the same live
    pieces), or with ``fused=False`` the shards themselves."""
    if not needs_staging(group, dtype):
        if not fused:
            yield group.shadows, group.live_tensors
            return
        live_tensors, shadow_sets = group.fused_live, group.fused_shadows
        batch = max(1, len(live_tensors))
        if len(group.shadows) > 1 and live_tensors:
            batch = max(1, CACHE_BYTES // live_tensors[0].nbytes)
        for start in range(0, len(live_tensors), batch):
            yield [fused[start : start + batch] for fused in shadow_sets], live_tensors[start : start + batch]
        return
    yield from stager.stage(group.shadows, group.live_tensors, dtype or group.live_tensors[0].dtype, split=fused)
