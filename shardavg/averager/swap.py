"""Writing an average into the tensors the model's forward reads: for a block, or for good.

Shard-local: each rank writes its shadows into its own local shards (under FSDP and ZeRO-3 the
forward then gathers the averaged shards as it gathers the live ones). Where every rank holds
the whole live tensors but averages a part of them (ZeRO-1/2 fp32 masters), the average is
gathered into them instead: a collective.

Both write the live weights, which another averager of the same model may be reading in the
background: each write (on entering a ``swapped()`` block, on leaving it, ``copy_into_model``)
first waits for every update in flight in the process (``wait_for_every_update``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..update.background import wait_for_every_update
from .average_state import AverageState


@contextlib.contextmanager
def swapped(state: AverageState, average: str | None) -> Iterator[None]:
    """Inside the block the live model holds ``average``; the local shards come back on exit.

    The local shards are stashed and written back bit for bit, also when the block raises.

    Args:
        state: The averager's state.
        average: The average's name; None for the only one.

    Yields:
        Nothing: the model holds the average until the block ends.

    Raises:
        ValueError: No average of that name, or None while several averages are kept.
        RuntimeError: No update applied yet, or a ``swapped()`` block already active.
        ModelChangedError: The model's tensors are no longer those the averager was built on.
    """
    indices = _stored(state, average, "swapped()", "swapped() blocks cannot be nested")
    wait_for_every_update()
    targets = state.strategy.swap_views()  # the tensors the forward reads
    with torch.no_grad():
        stash = [targets[index].clone() for index in indices]
    state.swapped = True
    try:
        _write(state, targets, indices, average)
        yield
    finally:
        try:
            wait_for_every_update()  # (another averager's update may have started inside the block)
        finally:  # (the live weights come back even if an interrupt cut that wait short)
            with torch.no_grad():
                targets = state.strategy.swap_views()  # the engine may have re-created views inside the block
                torch._foreach_copy_([targets[i] for i in indices], stash)
                state.strategy.release_gathered()
            state.swapped = False
        state.updater.follow(state.current_views())


def copy_into_model(state: AverageState, average: str | None) -> None:
    """Write ``average`` into the live model for good: the live weights are lost.

    Args:
        state: The averager's state.
        average: The average's name; None for the only one.

    Raises:
        ValueError: No average of that name, or None while several averages are kept.
        RuntimeError: No update applied yet, or inside ``swapped()``.
        ModelChangedError: The model's tensors are no longer those the averager was built on.
    """
    nested = "copy_into_model() inside swapped(): the live model holds averaged weights already"
    indices = _stored(state, average, "copy_into_model()", nested)
    wait_for_every_update()
    _write(state, state.strategy.swap_views(), indices, average)
    state.updater.follow(state.current_views())
    state.updater.check.distrust()  # (the live weights are new: no verdict has seen them)


def _stored(state: AverageState, average: str | None, what: str, nested: str) -> list[int]:
    """Before the average is written into the model: it exists and has updates, no swap is
    active (``nested`` otherwise), the model is the one averaged; the tensors to write."""
    shadows = state.average(average).shadows
    state.require_updates(what)
    if state.swapped:
        raise RuntimeError(nested)
    state.verify_structure()
    return [index for index, shadow in enumerate(shadows) if shadow is not None]


def _write(state: AverageState, targets: list[torch.Tensor], indices: list[int], average: str | None) -> None:
    """Copy the average's tensors ``indices`` into ``targets`` (the tensors the forward reads)."""
    shadows = state.average(average).shadows
    with torch.no_grad():
        state.strategy.release_gathered()
        if state.strategy.swap_gathers:  # each rank averages a part of tensors it holds whole
            where = {state.infos[i].name: i for i in indices}
            for info, full in state.gathered(dst=None, average=average):
                if info.name in where:
                    targets[where[info.name]].copy_(full.view_as(targets[where[info.name]]))
        else:
            torch._foreach_copy_([targets[i] for i in indices], [shadows[i] for i in indices])
