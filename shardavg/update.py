"""The update itself: shadows and live shards grouped for a handful of fused ``_foreach`` calls.

A group holds tensors that one call can update together: the same role (averaged or
copied), shadow device and dtype, and live dtype and device. Nothing here loops over
parameters in Python except where a bounded staging copy is unavoidable (shadows on
another device than the live shards, or a custom rule that needs the shadow dtype).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from .rules import MultiAvgFn

Role = Literal["average", "copy", "live"]  # averaged; copied at each update; not stored (live value exported)
STAGING_BYTES = 64 * 2**20  # bound on temporary copies of live shards (offload, dtype casts)
dtype_and_device = operator.attrgetter("dtype", "device")


@dataclass
class UpdateGroup:
    role: Role
    live_key: tuple[torch.dtype, torch.device]
    indices: list[int] = field(default_factory=list)
    shadows: list[torch.Tensor] = field(default_factory=list)
    lives: list[torch.Tensor] = field(default_factory=list)


def group_tensors(
    roles: Sequence[Role], shadows: Sequence[torch.Tensor | None], lives: Sequence[torch.Tensor]
) -> list[UpdateGroup]:
    groups: dict[tuple, UpdateGroup] = {}
    for index, (role, shadow, live) in enumerate(zip(roles, shadows, lives)):
        if shadow is None:
            continue
        key = (role, shadow.device, shadow.dtype, live.dtype, live.device)
        group = groups.setdefault(key, UpdateGroup(role, dtype_and_device(live)))
        group.indices.append(index)
        group.shadows.append(shadow)
        group.lives.append(live)
    return list(groups.values())


def groups_current(groups: Sequence[UpdateGroup]) -> bool:
    """Whether every live shard still has the dtype and device its group was built for."""
    return all(set(map(dtype_and_device, group.lives)) == {group.live_key} for group in groups)


def nonfinite(groups: Sequence[UpdateGroup]) -> list[int]:
    """Indices of live shards holding NaN or infinity.

    One fused norm per group screens them (any NaN or infinity makes the norm non-finite;
    finite values only do so by overflow, above ~1e19) and one flag per group is read on the
    host; only a positive screen is followed by the exact per-tensor check.
    """
    screened = []
    for group in groups:
        if group.lives[0].dtype.is_floating_point:
            accumulate = torch.promote_types(group.lives[0].dtype, torch.float32)
            norms = torch._foreach_norm(group.lives, 2, dtype=accumulate)
            if not bool(torch.stack(norms).isfinite().all()):
                screened.append(group)
    return [
        index
        for group in screened
        for index, live in zip(group.indices, group.lives)
        if not bool(torch.isfinite(live).all())
    ]


def _staged(group: UpdateGroup, dtype: torch.dtype | None) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(shadows, lives) with the lives on the shadows' device (and ``dtype``), in bounded buckets."""
    device = group.shadows[0].device
    if group.lives[0].device == device and dtype in (None, group.lives[0].dtype):
        yield group.shadows, group.lives
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
    torch._foreach_copy_(group.shadows, group.lives)


def lerp(group: UpdateGroup, weight: float) -> None:
    """``shadow += weight * (live - shadow)``."""
    for shadows, lives in _staged(group, dtype=None):
        if shadows[0].dtype == lives[0].dtype:  # bitwise as AveragedModel's EMA
            torch._foreach_lerp_(shadows, lives, weight)
        else:  # lerp refuses mixed dtypes; this is 4x faster than casting the lives first
            torch._foreach_mul_(shadows, 1.0 - weight)
            torch._foreach_add_(shadows, lives, alpha=weight)


def apply_custom(group: UpdateGroup, fn: MultiAvgFn, num_updates: torch.Tensor) -> None:
    """Call a ``multi_avg_fn`` with live shards cast to the shadow dtype, as AveragedModel would see them."""
    for shadows, lives in _staged(group, dtype=group.shadows[0].dtype):
        fn(shadows, lives, num_updates)
