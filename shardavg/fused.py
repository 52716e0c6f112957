"""The update's kernels: shadows and live shards grouped for a handful of fused ``_foreach`` calls.

A group holds tensors that one call can update together: the same role (averaged or
copied), shadow device and dtype, and live dtype and device. It holds one list of shadows per
average kept (copied tensors have one, shared by all), so each live shard is read, screened
and staged once per update however many averages take it in. Within a group, neighbours that
lie back to back in memory on both sides (FSDP1's flat shard, ZeRO-3's flattened partitions,
against shadows carved from one slab) are fused into one flat view, so the kernels run over
a few large tensors instead of one small tensor per parameter; the elementwise results are
the same bits. Small shards that lie apart (an FSDP2 bias, a LayerNorm weight: one tensor per
parameter, where a kernel's launch costs more than its work) are gathered by one copy into a
staging buffer of their group, and screened and updated there as one tensor (``Gathered``).
Nothing here loops over parameters in Python except where a bounded staging copy is unavoidable
(shadows on another device than the live shards, or a custom rule that needs the shadow dtype).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .options import Role
from .rules import MultiAvgFn
from .staging import Stager

# Fused views are cut into pieces of at most this many elements: on CPU a mixed-dtype add or a
# bf16 norm over one huge tensor runs 4-6x slower than over 1M-element pieces (measured).
FUSED_CHUNK = 2**20
# With several averages, the fused pieces are walked in batches of about this many live bytes, so
# each piece is still in cache when the next average reads it.
CACHE_BYTES = 4 * 2**20
# A shard of at most this many elements that lies apart in memory is gathered (``Gathered``), when
# its group has at least GATHER_MIN of them, up to GATHER_BYTES of staging per group.
GATHER_NUMEL, GATHER_MIN, GATHER_BYTES = 4096, 8, 16 * 2**20
data_ptr = torch.Tensor.data_ptr


@dataclass
class Gathered:
    """A group's small shards that lie apart in memory, copied at each update into one staging
    buffer, so that the non-finite screen and the update of all of them are one kernel each:
    their shadows lie back to back in every average (``AverageState`` carves them so)."""

    positions: list[int]  # in the group's lists
    live_tensors: list[torch.Tensor]
    views: list[torch.Tensor]  # of ``staging``, one per live shard, in its shape
    staging: torch.Tensor  # flat, the live dtype
    shadows: list[torch.Tensor]  # per average: its shadows of these shards as one flat view

    def stage(self) -> None:
        torch._foreach_copy_(self.views, self.live_tensors)


@dataclass
class UpdateGroup:
    role: Role
    indices: list[int] = field(default_factory=list)
    shadows: list[list[torch.Tensor]] = field(default_factory=list)  # one list per average (one if copied)
    live_tensors: list[torch.Tensor] = field(default_factory=list)
    # the same elements, neighbours in memory merged into one flat view (see ``fuse``)
    fused_shadows: list[list[torch.Tensor]] = field(default_factory=list)
    fused_live: list[torch.Tensor] = field(default_factory=list)
    live_pointers: list[int] = field(default_factory=list)  # where each live shard's data was
    # The host-side update's view of the group: the gathered small shards, and the fused views of
    # the others (the device-side check and custom rules walk ``fused_*``, every shard)
    gathered: Gathered | None = None
    direct_shadows: list[list[torch.Tensor]] = field(default_factory=list)
    direct_live: list[torch.Tensor] = field(default_factory=list)


def group_tensors(
    roles: Sequence[Role], shadow_sets: Sequence[Sequence[torch.Tensor | None]], live_tensors: Sequence[torch.Tensor]
) -> list[UpdateGroup]:
    """Group the stored tensors; ``shadow_sets`` holds one list of shadows per average."""
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
        group.gathered = _gather(group)
        group.direct_shadows, group.direct_live = group.fused_shadows, group.fused_live
        if group.gathered is not None:
            rest = sorted(set(range(len(group.live_tensors))) - set(group.gathered.positions))
            sets = [[shadows[p] for p in rest] for shadows in group.shadows]
            group.direct_shadows, group.direct_live = fuse(sets, [group.live_tensors[p] for p in rest])
    return list(groups.values())


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
    """The group's gatherable shards, when there are enough, they need no cast or move, and their
    shadows lie back to back in every average; else None."""
    live_tensors, first_shadow = group.live_tensors, group.shadows[0][0]
    if live_tensors[0].dtype != first_shadow.dtype or live_tensors[0].device != first_shadow.device:
        return None
    positions, size = [], 0
    for p in gatherable(live_tensors):
        size += live_tensors[p].nbytes
        if size > GATHER_BYTES:
            break
        positions.append(p)
    if len(positions) < GATHER_MIN:
        return None
    for shadows in group.shadows:
        members = [shadows[p] for p in positions]
        if not all(map(_adjacent, members, members[1:])):
            return None
    members = [live_tensors[p] for p in positions]
    staging = torch.empty(
        sum(live.numel() for live in members), dtype=live_tensors[0].dtype, device=live_tensors[0].device
    )
    views = [piece.view(live.shape) for piece, live in zip(staging.split([m.numel() for m in members]), members)]
    shadows = [s[positions[0]].detach().as_strided(staging.shape, (1,)) for s in group.shadows]
    return Gathered(positions, members, views, staging, shadows)


def stage_gathered(groups: Sequence[UpdateGroup]) -> None:
    """Copy every group's gathered small shards into its staging buffer (before the host-side
    screen and update, which read them there)."""
    for group in groups:
        if group.gathered is not None:
            group.gathered.stage()


def _set_count(role: Role, shadow_sets: Sequence[Sequence]) -> int:
    """Copied tensors have one shadow, shared by every average: it is written once."""
    return len(shadow_sets) if role == "average" else 1


def fuse(shadow_sets: Sequence[Sequence[torch.Tensor]], live_tensors: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Merge each run of tensors that are back to back in memory on every side (the live shards
    and each average's shadows) into one flat view, cut into ``FUSED_CHUNK`` pieces (empty
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
            fused_live.extend(_pieces(live_tensors[start:stop]))
            for fused, shadows in zip(fused_sets, shadow_sets):
                fused.extend(_pieces(shadows[start:stop]))
        else:  # a strided live shard (adjacency needs dense ones, so it is alone): as it is
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


def _pieces(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Flat views of at most ``FUSED_CHUNK`` elements over adjacent dense tensors."""
    span = tensors[0].detach().as_strided((sum(t.numel() for t in tensors),), (1,))
    return list(span.split(FUSED_CHUNK))


def groups_current(groups: Sequence[UpdateGroup]) -> bool:
    """Whether every live shard's data is still where its group (and its fused views) found it.

    A cast or a move (``model.to(...)``), or ``param.data = other``, gives a tensor new data
    while the object stays the same: its pointer tells, at C speed per tensor."""
    return all(list(map(data_ptr, group.live_tensors)) == group.live_pointers for group in groups)


def nonfinite(groups: Sequence[UpdateGroup], gathered: bool = False) -> list[int]:
    """Indices of live shards holding NaN or infinity.

    One ``_foreach_norm`` over the group's fused views (with ``gathered``: the direct ones and the
    staged small shards, as ``stage_gathered`` left them) screens them (any NaN or infinity makes a
    norm non-finite; finite values only do so when their squares overflow fp32) and one flag per
    group is read on the host; only a positive screen is followed by the exact per-tensor check.
    """
    screened = []
    for group in groups:
        screen = group.fused_live
        if gathered and group.gathered is not None:
            screen = [*group.direct_live, group.gathered.staging]
        if screen and group.live_tensors[0].dtype.is_floating_point:
            accumulate = torch.promote_types(group.live_tensors[0].dtype, torch.float32)
            norms = torch._foreach_norm(screen, 2, dtype=accumulate)
            if not bool(torch.stack(norms).isfinite().all()):
                screened.append(group)
    return [
        index
        for group in screened
        for index, live in zip(group.indices, group.live_tensors)
        if not bool(torch.isfinite(live).all())
    ]


# What one average does in an update: copy the live values (``None``), lerp toward them by a
# weight, or call a custom rule's ``multi_avg_fn`` with ``num_updates`` as a device tensor.
Step = float | None | tuple[MultiAvgFn, torch.Tensor]


def apply(group: UpdateGroup, steps: Sequence[Step], stager: Stager, gathered: bool = False) -> None:
    """Apply each average's step to its shadows in ``group``, staging each live shard once for all;
    with ``gathered``, the small shards from the staging buffer ``stage_gathered`` filled.

    A custom rule sees live shards cast to the shadow dtype, one tensor per parameter shard as
    AveragedModel would show them (never fused: the function may look at shapes)."""
    custom = any(isinstance(step, tuple) for step in steps)
    dtype = group.shadows[0][0].dtype if custom else None
    same_dtype = group.live_tensors[0].dtype == group.shadows[0][0].dtype  # as the shards are, staged or not
    # (when the live_tensors must be staged, as the gathered ones never need, every shard is staged instead)
    direct = gathered and group.gathered is not None and not custom and not needs_staging(group, dtype)
    pairs = staged(group, dtype, stager, fused=not custom, direct=direct)
    if direct:  # (the gathered shards' dtype and device are the shadows': see ``_gather``)
        pairs = itertools.chain(pairs, [([[shadow] for shadow in group.gathered.shadows], [group.gathered.staging])])
    for shadow_sets, live_tensors in pairs:
        for shadows, step in zip(shadow_sets, steps):
            if step is None:
                torch._foreach_copy_(shadows, live_tensors)
            elif isinstance(step, tuple):
                step[0](shadows, live_tensors, step[1])
            elif same_dtype:  # bitwise as AveragedModel's EMA
                torch._foreach_lerp_(shadows, live_tensors, step)
            else:  # lerp refuses mixed dtypes; this is 4x faster than casting the live_tensors first
                torch._foreach_mul_(shadows, 1.0 - step)
                torch._foreach_add_(shadows, live_tensors, alpha=step)


class Verdict(NamedTuple):
    """Which live shards held NaN or infinity, on the host once ``event`` (if any) has completed."""

    indices: list[int]
    bad: torch.Tensor  # bool per shard in ``indices``, on the host
    event: torch.Event | None  # recorded after the copy to the host; None when nothing was copied


def screen_on_device(groups: Sequence[UpdateGroup]) -> tuple[list[Verdict], dict[torch.device, torch.Tensor]]:
    """The non-finite screen with no host read: per device, a ``Verdict`` copied to the host behind
    an event, and ``ok[device]``, a 0-d device flag that no live shard there is non-finite. An
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
        if device.type == "cpu":
            verdicts.append(Verdict(indices[device], bad, None))
        else:  # into pinned host memory, read once the event says it landed
            event = torch.Event(device=device)
            host = bad.to("cpu", non_blocking=True)
            event.record()
            verdicts.append(Verdict(indices[device], host, event))
    return verdicts, oks


def apply_masked(group: UpdateGroup, ok: torch.Tensor, weights: Sequence[torch.Tensor | None], stager: Stager) -> None:
    """The update made conditional on the device: each average lerps toward ``where(ok, live,
    shadow)`` with its weight as a 0-d device tensor (``None``: copy), so when ``ok`` is false no
    shadow changes. One bounded piece (a fused view or a staged bucket) at a time."""
    for shadow_sets, live_tensors in staged(group, None, stager):
        for shadows, weight in zip(shadow_sets, weights):
            for shadow, live in zip(shadows, live_tensors):
                masked = torch.where(ok, live, shadow)
                if weight is None:
                    shadow.copy_(masked)
                else:
                    shadow.lerp_(masked, weight)


def needs_staging(group: UpdateGroup, dtype: torch.dtype | None) -> bool:
    """Whether the live shards must be copied before the update: to the shadows' device, or to ``dtype``."""
    return group.live_tensors[0].device != group.shadows[0][0].device or dtype not in (
        None,
        group.live_tensors[0].dtype,
    )


def staged(
    group: UpdateGroup, dtype: torch.dtype | None, stager: Stager, fused: bool = True, direct: bool = False
) -> Iterator[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]:
    """(shadows per average, live_tensors) with the live_tensors on the shadows' device (and ``dtype``), in
    bounded buckets (``staging.py``), each staged once for every average. When nothing needs
    staging: the fused views (in cache-sized batches when several averages read the same live
    pieces; with ``direct``, those of the shards not gathered), or with ``fused=False`` the
    shards themselves."""
    if not needs_staging(group, dtype):
        if not fused:
            yield group.shadows, group.live_tensors
            return
        live_tensors = group.direct_live if direct else group.fused_live  # empty when every shard in the group is
        shadow_sets = group.direct_shadows if direct else group.fused_shadows
        batch = max(1, len(live_tensors))
        if len(group.shadows) > 1 and live_tensors:
            batch = max(1, CACHE_BYTES // live_tensors[0].nbytes)
        for start in range(0, len(live_tensors), batch):
            yield [fused[start : start + batch] for fused in shadow_sets], live_tensors[start : start + batch]
        return
    yield from stager.stage(group.shadows, group.live_tensors, dtype or group.live_tensors[0].dtype, split=fused)
