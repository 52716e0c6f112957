"""BatchNorm statistics recomputed under an average and kept in it: SWA's last step, shard-local.

An average of weights is not an average of the BatchNorm statistics those weights would see, so
SWA ends with ``torch.optim.swa_utils.update_bn(loader, swa_model)``: one pass over the data with
the averaged weights in the model, every BatchNorm's running statistics reset and accumulated as
an equal-weight mean over the batches. Run inside ``swapped()`` alone, it computes them into the
live buffers and loses them on exit, when the live buffers come back. ``update_bn`` here runs
torch's own inside ``swapped()`` and, before the block ends, writes the statistics it left into
the average's buffers, so that an export, a gather or ``swapped()`` afterwards has them. The
next ``update()`` copies (``buffers="copy"``) or averages (``"average"``) the live buffers into
them again, as the next ``update_parameters`` does after torch's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..strategies.base import canonical_name, unwrap
from . import swap
from .average_state import AverageState

# The BatchNorms torch's update_bn recomputes (its _BatchNorm, by the public classes; a lazy one
# becomes one of these once it has seen its first input).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def update_bn(
    loader: Iterable[Any], state: AverageState, average: str | None, device: torch.device | str | None
) -> list[str]:
    """Recompute the BatchNorm statistics under ``average`` (see the module's docstring) and keep
    them in its buffers; returns their names. None where the model has no BatchNorm or the averager
    stores none of its buffers (``buffers="ignore"``): then nothing runs and nothing changes."""
    model = state.strategy.model
    shadows = state.average(average).shadows
    kept = [index for index in _statistics(state) if shadows[index] is not None]
    if not kept:  # (no BatchNorm, or buffers="ignore": the exports carry the live statistics, left alone)
        return []
    others = [other.shadows for other in state.averages.values() if other.shadows is not shadows]
    shared = [  # (an integer count, num_batches_tracked, is one copy for all under either mode: it takes the loader's)
        state.infos[index].name
        for index in kept
        if shadows[index].is_floating_point() and any(other[index] is shadows[index] for other in others)  # type: ignore[union-attr]
    ]
    if shared:
        raise ValueError(
            f"update_bn(average={average!r}): the averages share one copy of {shared} (buffers='copy' copies the "
            "live buffers once for all): their statistics would change for every average; build the averager with "
            "buffers='average' to keep statistics per average"
        )
    with swap.swapped(state, average):
        torch.optim.swa_utils.update_bn(loader, model, device)
        targets = state.strategy.swap_views()
        with torch.no_grad():
            for index in kept:
                shadows[index].copy_(targets[index])  # type: ignore[union-attr]
    return [state.infos[index].name for index in kept]


def _statistics(state: AverageState) -> list[int]:
    """The indices of the model's BatchNorm statistics among the averager's tensors."""
    owners = unwrap(state.strategy.model)
    names = {
        canonical_name(f"{prefix}.{name}" if prefix else name)
        for prefix, module in owners.named_modules()
        if isinstance(module, BATCH_NORMS)
        for name in ("running_mean", "running_var", "num_batches_tracked")
    }
    infos = enumerate(state.infos)
    return [index for index, info in infos if info.kind == "buffer" and {info.name, *info.aliases} & names]
