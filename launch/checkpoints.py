"""The main job's checkpoints: model, optimizer, data position and every average, resumable bitwise.

``OUT/checkpoints/step-NNNNNNNN/`` holds either a ``torch.distributed.checkpoint`` (DDP, FSDP1,
FSDP2, HSDP: model and optimizer through ``get_state_dict``, each average as a DCP Stateful) or,
under ZeRO-3, the DeepSpeed engine's own checkpoint plus each average's ``save``. A checkpoint
is written into a hidden staging folder and renamed into place once every rank is done, with
``train.json`` (the step) written last: a folder without it was never finished and is ignored.
Only folders with that marker are ever pruned.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from engines import Wrapped
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardavg import WeightAverager

MARKER = "train.json"
STEP = re.compile(r"step-(\d{8})")


def save(root: Path, step: int, wrapped: Wrapped, averages: dict[str, WeightAverager], keep_last: int) -> Path:
    """Collective: a checkpoint of everything training needs at ``step``; returns its folder."""
    target = root / f"step-{step:08d}"
    staging = root / f".step-{step:08d}.partial"
    if target.exists() and not (target / MARKER).is_file():
        raise RuntimeError(f"{target} exists and is not a checkpoint of this job: refusing to replace it")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt at this step
        staging.mkdir(parents=True)
    dist.barrier()
    if wrapped.kind == "zero3":
        wrapped.deepspeed_engine.save_checkpoint(str(staging), tag="engine", save_latest=False)
        for name, average in averages.items():
            average.save(staging / f"average-{name}")
    else:
        dcp.save(_dcp_state(wrapped, averages, step), checkpoint_id=str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        (staging / MARKER).write_text(json.dumps({"step": step, "engine": wrapped.kind}))
        if target.exists():  # this job's own, from a run resumed from an earlier step
            shutil.rmtree(target)
        staging.rename(target)
        for old in finished(root)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()
    return target


def finished(root: Path) -> list[Path]:
    """The job's committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP.fullmatch(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(STEP.fullmatch(p.name).group(1)))


def load(folder: Path, wrapped: Wrapped, averages: dict[str, WeightAverager]) -> int:
    """Collective: restore everything from ``folder``; returns the step it was saved at."""
    step = json.loads((folder / MARKER).read_text())["step"]
    if wrapped.kind == "zero3":
        loaded, _ = wrapped.deepspeed_engine.load_checkpoint(str(folder), tag="engine")
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no engine checkpoint in {folder}")
        for name, average in averages.items():
            average.load(folder / f"average-{name}")
        return step
    state = _dcp_state(wrapped, averages, step=-1)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        wrapped.model, wrapped.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    if int(state["step"]) != step:
        raise RuntimeError(f"{folder}: {MARKER} says step {step}, the checkpoint holds step {int(state['step'])}")
    return step


def _dcp_state(wrapped: Wrapped, averages: dict[str, WeightAverager], step: int) -> dict:
    model, optimizer = get_state_dict(wrapped.model, wrapped.optimizer)
    state = {"model": model, "optimizer": optimizer, "step": torch.tensor(step)}
    return state | {f"average-{name}": average for name, average in averages.items()}
