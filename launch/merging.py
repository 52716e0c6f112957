"""``merge.last: K``: at the end of training, the uniform average of the run's newest K checkpoints
(LAWA), evaluated and exported like the averages kept during training.

Rank 0 averages the checkpoints' model entries with ``shardavg.merge`` into ``OUT/merge/`` (an
averager's checkpoint, fp32, replacing a previous run's); every rank then loads it into an SWA
averager of the live model, which takes its own shard of each tensor at this run's layout, so the
merge is evaluated through ``swapped()`` and exported like any average, whatever the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import shardavg
from launch import checkpoints
from launch.engines import Wrapped
from shardavg import SWA, WeightAverager

log = logging.getLogger("train")

FOLDER = "merge"  # under OUT


class MergeFailed(RuntimeError):
    """The checkpoints could not be merged: raised on every rank alike, with rank 0's reason."""


@dataclass
class Merged:
    """The merge of the newest checkpoints, loaded into an averager of the live model."""

    name: str  # "merge-lastK": its name in the held-out losses and under export/
    steps: list[int]  # of the checkpoints merged, oldest first
    average: WeightAverager


def merge_last(out: Path, last: int, wrapped: Wrapped) -> Merged:
    """Collective: rank 0 merges the newest ``last`` finished checkpoints of ``OUT/checkpoints``
    (their model entries, in fp32); every rank loads the merge into an SWA averager."""
    reason, steps = None, []
    if dist.get_rank() == 0:
        found = checkpoints.finished(out / "checkpoints")[-last:]
        steps = [checkpoints.step_of(folder) for folder in found]
        try:
            shardavg.merge(out, out / FOLDER, last=last, prefix="model.", dtype=torch.float32, output="shardavg")
        except (shardavg.CheckpointError, ValueError, OSError) as error:
            reason = f"merge.last={last}: {error}"
    shared = [reason, steps]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise MergeFailed(shared[0])
    average = WeightAverager(wrapped.model, SWA(), **wrapped.averager_options)
    average.load(out / FOLDER)
    plural = "" if last == 1 else "s"
    log.info("merged the last %d checkpoint%s (steps %s) into %s", last, plural, shared[1], out / FOLDER)
    return Merged(f"merge-last{last}", shared[1], average)
