"""The update itself: shadows and live shards grouped for a handful of fused ``_foreach`` calls.

A group holds tensors that one call can update together: the same role (averaged or
copied), shadow device and dtype, and live dtype and device. Within a group, neighbours that
lie back to back in memory on both sides (FSDP1's flat shard, ZeRO-3's flattened partitions,
against shadows carved from one slab) are fused into one flat view, so the kernels run over
a few large tensors instead of one small tensor per parameter; the elementwise results are
the same bits. Nothing here loops over parameters in Python except where a bounded staging
copy is unavoidable (shadows on another device than the live shards, or a custom rule that
needs the shadow dtype).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from .rules import MultiAvgFn

Role = Literal["average", "copy", "live"]  # averaged; copied at each update; not stored (live value exported)
STAGING_BYTES = 64 * 2**20  # bound on temporary copies of live shards (offload, dtype casts)
# Fused views are cut into pieces of at most this many elements: on CPU a mixed-dtype add or a
# bf16 norm over one huge tensor runs 4-6x slower than over 1M-element pieces (measured).
FUSED_CHUNK = 2**20
data_ptr = torch.Tensor.data_ptr


@dataclass
class UpdateGroup:
    role: Role
    indices: list[int] = field(default_factory=list)
    shadows: list[torch.Tensor] = field(default_factory=list)
    lives: list[torch.Tensor] = field(default_factory=list)
    # the same elements, neighbours in memory merged into one flat view (see ``fuse``)
    fused_shadows: list[torch.Tensor] = field(default_factory=list)
    fused_lives: list[torch.Tensor] = field(default_factory=list)
    live_pointers: list[int] = field(default_factory=list)  # where each live shard's data was


def group_tensors(
    roles: Sequence[Role], shadows: Sequence[torch.Tensor | None], lives: Sequence[torch.Tensor]
) -> list[UpdateGroup]:
    groups: dict[tuple, UpdateGroup] = {}
    for index, (role, shadow, live) in enumerate(zip(roles, shadows, lives)):
        if shadow is None:
            continue
        key = (role, shadow.device, shadow.dtype, live.dtype, live.device)
        group = groups.setdefault(key, UpdateGroup(role))
        group.indices.append(index)
        group.shadows.append(shadow)
        group.lives.append(live)
    for group in groups.values():
        group.fused_shadows, group.fused_lives = fuse(group.shadows, group.lives)
        group.live_pointers = list(map(data_ptr, group.lives))
    return list(groups.values())


def fuse(shadows: Sequence[torch.Tensor], lives: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Merge each run of pairs that are back to back in memory on both sides into one flat view,
    cut into ``FUSED_CHUNK`` pieces (empty shards, which have no place in memory, are left out:
    there is nothing to update)."""
    pairs = [(shadow, live) for shadow, live in zip(shadows, lives) if live.numel()]
    shadows, lives = [shadow for shadow, _ in pairs], [live for _, live in pairs]
    fused_shadows, fused_lives, start = [], [], 0
    for stop in range(1, len(lives) + 1):
        if (
            stop < len(lives)
            and _adjacent(lives[stop - 1], lives[stop])
            and _adjacent(shadows[stop - 1], shadows[stop])
        ):
            continue
        if lives[start].is_contiguous() and shadows[start].is_contiguous():
            fused_shadows.extend(_pieces(shadows[start:stop]))
            fused_lives.extend(_pieces(lives[start:stop]))
        else:  # a strided live shard (adjacency needs dense ones, so it is alone): as it is
            fused_shadows.append(shadows[start])
            fused_lives.append(lives[start])
        start = stop
    return fused_shadows, fused_lives


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
    return all(list(map(data_ptr, group.lives)) == group.live_pointers for group in groups)


def nonfinite(groups: Sequence[UpdateGroup]) -> list[int]:
    """Indices of live shards holding NaN or infinity.

    One ``_foreach_norm`` over the group's fused views screens them (any NaN or infinity makes a
    norm non-finite; finite values only do so when their squares overflow fp32) and one flag per
    group is read on the host; only a positive screen is followed by the exact per-tensor check.
    """
    screened = []
    for group in groups:
        if group.fused_lives and group.lives[0].dtype.is_floating_point:
            accumulate = torch.promote_types(group.lives[0].dtype, torch.float32)
            norms = torch._foreach_norm(group.fused_lives, 2, dtype=accumulate)
            if not bool(torch.stack(norms).isfinite().all()):
                screened.append(group)
    return [
        index
        for group in screened
        for index, live in zip(group.indices, group.lives)
        if not bool(torch.isfinite(live).all())
    ]


def _staged(group: UpdateGroup, dtype: torch.dtype | None) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(shadows, lives) with the lives on the shadows' device (and ``dtype``), in bounded buckets;
    the fused views when nothing needs staging."""
    device = group.shadows[0].device
    if group.lives[0].device == device and dtype in (None, group.lives[0].dtype):
        if group.fused_lives:  # empty when every shard in the group is
            yield group.fused_shadows, group.fused_lives
        return
    start = 0
    while start < len(group.lives):
        stop, size = start, 0
        while stop < len(group.lives) and (stop == start or size + group.lives[stop].nbytes <= STAGING_BYTES):
            size += group.lives[stop].nbytes
            stop += 1
        yield group.shadows[start:stop], [live.to(device=device, dtype=dtype) for live in group.lives[start:stop]]
        start = stop


def copy_live(group: UpdateGroup) -> None:
    if group.fused_lives:
        torch._foreach_copy_(group.fused_shadows, group.fused_lives)


def lerp(group: UpdateGroup, weight: float) -> None:
    """``shadow += weight * (live - shadow)``."""
    for shadows, lives in _staged(group, dtype=None):
        if shadows[0].dtype == lives[0].dtype:  # bitwise as AveragedModel's EMA
            torch._foreach_lerp_(shadows, lives, weight)
        else:  # lerp refuses mixed dtypes; this is 4x faster than casting the lives first
            torch._foreach_mul_(shadows, 1.0 - weight)
            torch._foreach_add_(shadows, lives, alpha=weight)


def apply_custom(group: UpdateGroup, fn: MultiAvgFn, num_updates: torch.Tensor) -> None:
    """Call a ``multi_avg_fn`` with live shards cast to the shadow dtype, as AveragedModel would see them
    (one tensor per parameter shard, never fused: the function may look at shapes)."""
    if group.lives[0].device == group.shadows[0].device and group.lives[0].dtype == group.shadows[0].dtype:
        fn(group.shadows, group.lives, num_updates)
        return
    for shadows, lives in _staged(group, dtype=group.shadows[0].dtype):
        fn(shadows, lives, num_updates)
