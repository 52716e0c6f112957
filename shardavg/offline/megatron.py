"""Megatron-Core's ``torch_dist`` checkpoints, as ``dist_checkpointing.save`` writes them.

A ``torch_dist`` checkpoint is a ``torch.distributed.checkpoint`` folder with Megatron's own
``metadata.json`` (``"sharded_backend": "torch_dist"``) beside it, and its common state in
``common.pt`` (Megatron-Core up to 0.16) or in the entry ``common_state/shard_0_1`` (0.19). Its keys are
flat (``decoder.layers.self_attention.linear_qkv.weight``, a layer stack ``[L, ...]`` stored in
chunks by layer and tensor-parallel offset), with the optimizer's state beside the model under
``optimizer.`` and Python objects (``rng_state``, ``common_state``, Transformer Engine's
``*._extra_state``) as pickled bytes entries. The model is every tensor that is none of these;
the rest is left out unread (never unpickled), and counted by group so a merge can say what it
left out. Its steps are its ``iter_NNNNNNN`` folders, finished up to the one that
``latest_checkpointed_iteration.txt`` names.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..base.errors import CheckpointError
from ..checkpoints.format import DCP_METADATA
from .saved_average import DcpFolder

METADATA = "metadata.json"  # Megatron's record of the backend that wrote the folder
COMMON = "common.pt"  # its common state: a pickle, never loaded here
ITERATION = re.compile(r"^iter_(\d+)$")  # a Megatron-LM run's checkpoint of one step
TRACKER = "latest_checkpointed_iteration.txt"  # the newest finished iteration, written after its save
OBJECT_KEY = re.compile(r"/shard_[\d.]+_[\d.]+$")  # a ShardedObject's suffix in the DCP key
LEFT_OUT = ("optimizer", "common_state", "rng_state")  # (key prefixes) training state beside the model
EXTRA_STATE = "*._extra_state"  # Transformer Engine's per-module pickled state, by its name's end
CARRIED = (EXTRA_STATE, "common_state")  # the objects a DCP output carries from its newest input, as bytes
OBJECT_LIMIT = 2**26  # (bytes) the most a carried object of a layer may hold


def is_torch_dist(path: Path) -> bool:
    """Whether ``path`` holds Megatron's ``metadata.json`` naming the ``torch_dist`` backend."""
    try:
        record = json.loads((path / METADATA).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and record.get("sharded_backend") == "torch_dist"


def group_of(key: str) -> str | None:
    """The group of training state a Megatron key belongs to, or None for a model tensor."""
    name = OBJECT_KEY.sub("", key)
    if name.endswith("._extra_state") or name == "_extra_state":
        return EXTRA_STATE
    head = name.split(".")[0]
    return next((group for group in LEFT_OUT if head == group or head.startswith(f"{group}/")), None)


def model_tensors(folder: DcpFolder) -> tuple[dict[str, tuple[str, Any]], dict[str, int]]:
    """``{name: (key, stored)}`` of the model's tensors in a ``torch_dist`` checkpoint (its keys are
    the model's names), and ``{group: entries}`` of what was left out: the optimizer's tensors,
    ``common_state``, ``rng_state``, ``*._extra_state`` and any other pickled object (each by
    the name before its ``/shard_`` suffix), and ``common.pt`` when the folder holds one."""
    found, left_out = {}, Counter()
    for key, stored in folder.metadata.state_dict_metadata.items():
        key = str(key)
        group = group_of(key)
        if group is None and not isinstance(getattr(stored, "chunks", None), list):
            group = OBJECT_KEY.sub("", key)  # a pickled object of the model's: never read
        if group is None:
            found[key] = (key, stored)
        else:
            left_out[group] += 1
    if (folder.path / COMMON).is_file():
        left_out[COMMON] += 1
    if not found:
        raise CheckpointError(
            f"{folder.path} is a Megatron-Core torch_dist checkpoint holding no model tensor (only {sorted(left_out)})"
        )
    return found, dict(sorted(left_out.items()))


def iteration_of(folder: Path) -> int | None:
    """The step of a Megatron-LM checkpoint folder (``iter_0000100``: 100), else None."""
    match = ITERATION.match(folder.name)
    return int(match.group(1)) if match else None


def finished_iterations(run: Path) -> list[tuple[int, Path]] | None:
    """``(step, folder)`` of a Megatron-LM run folder's finished checkpoints, oldest first, or None
    where ``run`` is not one (no ``iter_*`` folder). A folder is finished when it holds its DCP
    ``.metadata`` and, where the run has a tracker file, its step is at most the one the tracker
    names (Megatron writes the tracker after a save completes: a newer folder is still being
    written, or was left by a save that died)."""
    folders = {folder: iteration_of(folder) for folder in run.iterdir() if folder.is_dir()}
    folders = {folder: step for folder, step in folders.items() if step is not None}
    if not folders:
        return None
    newest = _tracked(run)
    return sorted(
        (step, folder)
        for folder, step in folders.items()
        if (folder / DCP_METADATA).is_file() and (newest is None or step <= newest)
    )


def _tracked(run: Path) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None (absent, or ``release``)."""
    try:
        text = (run / TRACKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def carried(folder: DcpFolder) -> tuple[list[tuple[str, bytes]], list[Path]]:
    """What a merge written as a DCP checkpoint carries from its newest ``torch_dist`` input for
    Megatron to load it: the objects its load asks for, as DCP stored them (``(key, bytes)``, never
    unpickled): the model's ``*._extra_state`` and the common state (``common_state``, where
    Megatron-Core 0.19 keeps it, reading ``common.pt`` only where that exists); and its
    ``metadata.json`` and ``common.pt`` (copied byte for byte). The optimizer and ``rng_state`` are
    not a merge's (load it with ``--no-load-optim --no-load-rng``, or ``--finetune``)."""
    objects = []
    for key, stored in folder.metadata.state_dict_metadata.items():
        if group_of(str(key)) in CARRIED and not isinstance(getattr(stored, "chunks", None), list):
            file, start, length = folder.location(str(key), None, OBJECT_LIMIT)
            with open(file, "rb") as handle:
                handle.seek(start)
                objects.append((str(key), handle.read(length)))
    files = [folder.path / name for name in (METADATA, COMMON) if (folder.path / name).is_file()]
    return objects, files


def refusal(path: Path) -> CheckpointError | None:
    """The one-line refusal of a Megatron folder merge cannot read, naming what works: a checkpoint
    in Megatron's legacy ``torch`` format (``mp_rank_*/model_optim_rng.pt``, pickles holding its
    arguments), or a run folder named as one checkpoint; None for any other folder."""
    legacy = sorted(path.glob("mp_rank_*/model_optim_rng.pt")) + sorted(path.glob("mp_rank_*_*/model_optim_rng.pt"))
    if legacy:
        return CheckpointError(
            f"{path} is a Megatron-LM checkpoint in its legacy torch format ({legacy[0].relative_to(path)}, a pickle "
            "of Python objects, which shardavg never loads); convert it once with Megatron-LM: run your training "
            f"script with --load {path.parent} --ckpt-convert-format torch_dist --ckpt-convert-save OUT, and merge "
            "OUT's iter_* folder"
        )
    if finished_iterations(path) is not None or (path / TRACKER).is_file():
        return CheckpointError(
            f"{path} is a Megatron-LM run folder of several checkpoints: merge its iter_* folders by name, or its "
            f"newest K with --last K {path}"
        )
    return None
