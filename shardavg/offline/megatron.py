"""Megatron-Core's ``torch_dist`` checkpoints, as ``dist_checkpointing.save`` writes them.

A ``torch_dist`` checkpoint is a ``torch.distributed.checkpoint`` folder with Megatron's own
``metadata.json`` (``"sharded_backend": "torch_dist"``) beside it, and its common state in
``common.pt`` (Megatron-Core up to 0.16) or in the entry ``common_state/shard_0_1`` (0.19). Its keys are
flat (``decoder.layers.self_attention.linear_qkv.weight``, a layer stack ``[L, ...]`` stored in
chunks by layer and tensor-parallel offset), with the optimizer's state beside the model under
``optimizer.`` and Python objects (``rng_state``, ``common_state``, Transformer Engine's
``*._extra_state``) as pickled bytes entries; and any averager saved beside the model the way
docs/megatron.md shows (``**avg.sharded_state_dict(prefix="ema.")``): its averages under the prefix,
and its counters under ``{prefix}shardavg.counters`` (``Averager``). The model is every tensor that
is none of these; the rest is left out unread (never unpickled), and counted by group so a merge can
say what it left out (``contents``). Its steps are its ``iter_NNNNNNN`` folders, finished up to the
one that ``latest_checkpointed_iteration.txt`` names.

Such a folder is someone else's until checked: every file read here or carried into a merge
(``metadata.json``, ``common.pt``, the tracker) is a regular file ``confined`` to its folder (a
link out of it is refused by name), read within a bound; the objects a merge carries are located,
checked not to alias each other's bytes, and copied a piece at a time, never held (``carried``).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CheckpointError
from ..base.links import own_file
from ..base.untrusted import parse_json
from ..checkpoints.format import DCP_METADATA
from ..checkpoints.storage import read_bounded
from ..output.dcp_checkpoint import StoredBytes
from ..output.megatron_run import ITERATION, TRACKER
from .saved_average import DcpFolder

METADATA = "metadata.json"  # Megatron's record of the backend that wrote the folder
COMMON = "common.pt"  # its common state: a pickle, never loaded here
TRACKED = re.compile(r"[0-9]{1,18}|release")  # what Megatron-LM writes there (ASCII: "²".isdigit() is True)
SMALL_FILE = 2**16  # (bytes) the most metadata.json or the tracker may hold: Megatron writes a few dozen
OBJECT_KEY = re.compile(r"/shard_[\d.]+_[\d.]+$")  # a ShardedObject's suffix in the DCP key
LEFT_OUT = ("optimizer", "common_state", "rng_state")  # (key prefixes) training state beside the model
EXTRA_STATE = "*._extra_state"  # Transformer Engine's per-module pickled state, by its name's end
CARRIED = (EXTRA_STATE, "common_state")  # the objects a DCP output carries from its newest input, as bytes
OBJECT_LIMIT = 2**26  # (bytes) the most a carried object of a layer may hold
# (after its prefix) the key of an averager's counters, as ``avg.sharded_state_dict`` writes it
# (``strategies/megatron.py``'s ``COUNTERS``, which this package may not import; a test holds them equal)
COUNTERS = "shardavg.counters"
COUNTERS_SHAPE = (3,)  # its step, updates and skipped updates, an int64 tensor
MODEL = "model"  # the group the model's own tensors are left out under when an averager is what is merged


def is_torch_dist(path: Path) -> bool:
    """Whether ``path`` holds Megatron's ``metadata.json`` naming the ``torch_dist`` backend; one that
    links out of ``path``, or is no regular file, is refused by name (a merge would carry it), one
    that is not small JSON is not Megatron's."""
    file = _within(path / METADATA, path)
    if file is None:
        return False
    try:
        raw = read_bounded(file, SMALL_FILE, lambda size: CheckpointError(f"{file}: {size} bytes"))
    except (OSError, CheckpointError):
        return False
    try:
        record = parse_json(raw, file)  # (nested too deep: refused by name, not taken for another format)
    except ValueError:  # (UnicodeDecodeError is a ValueError)
        return False
    return isinstance(record, dict) and record.get("sharded_backend") == "torch_dist"


def _within(file: Path, folder: Path) -> Path | None:
    """The real path of the regular file ``file`` of ``folder`` (``links.own_file``: a link out of it,
    or a pipe, refused by name), or None where there is no such file (nor a link by its name)."""
    return own_file(file, folder, "Megatron writes a regular file there") if os.path.lexists(file) else None


def group_of(key: str) -> str | None:
    """The group of training state a Megatron key belongs to, or None for a model tensor."""
    name = OBJECT_KEY.sub("", key)
    if name.endswith("._extra_state") or name == "_extra_state":
        return EXTRA_STATE
    head = name.split(".")[0]
    return next((group for group in LEFT_OUT if head == group or head.startswith(f"{group}/")), None)


@dataclass(frozen=True)
class Averager:
    """An averager saved in the checkpoint by ``avg.sharded_state_dict(prefix)``, found by the entry
    only an averager writes: its counters, ``{prefix}shardavg.counters``, an int64 tensor of 3 (step,
    updates, skipped updates), whatever prefix the user chose (``""`` too). Everything else under its
    prefix is its own: its averages (``tensors``: the model's keys with the prefix before them) and
    its copy of the model's ``*._extra_state`` objects (``objects``). A merge of the models leaves it
    all out, by name (``group``): an average of averages restored with one input's counters would be
    no run's average."""

    prefix: str
    tensors: dict[str, Any]  # {key: stored}: its averages and its counters, as DCP stores them
    objects: tuple[str, ...]  # keys of its pickled objects, never unpickled

    @property
    def counters(self) -> str:
        return self.prefix + COUNTERS

    @property
    def group(self) -> str:
        """How a merge that leaves it out names it: in its report and its provenance's ``left_out``."""
        return f"{self.prefix}* (averager)"

    @property
    def entries(self) -> int:
        return len(self.tensors) + len(self.objects)

    def averages(self) -> dict[str, tuple[str, Any]]:
        """``{name: (key, stored)}`` of its averaged tensors, each named as the model's key (the prefix
        taken off), so that a merge of them is written, and loads, as the model."""
        return {key[len(self.prefix) :]: (key, stored) for key, stored in self.tensors.items() if key != self.counters}


@dataclass(frozen=True)
class Contents:
    """What a ``torch_dist`` checkpoint holds, each entry in one place: the model's tensors
    (``model``: ``{name: (key, stored)}``, its keys the model's names), the averagers saved beside
    it (``averagers``), the model's objects a DCP output carries (``objects``: its
    ``*._extra_state`` and ``common_state``) and ``{group: entries}`` of the training state left out
    (``left_out``: the optimizer, ``common_state``, ``rng_state``, ``*._extra_state``, any other
    pickled object, ``common.pt``; the averagers not among them)."""

    path: Path
    model: dict[str, tuple[str, Any]]
    averagers: list[Averager]
    objects: list[str]
    left_out: dict[str, int]

    def averager(self, key: str) -> Averager:
        """The averager saved under the prefix ``key`` (``"ema."``, or ``"ema"`` for it)."""
        found = {averager.prefix: averager for averager in self.averagers}
        chosen = found.get(key, found.get(f"{key}."))
        if chosen is None:
            held = f"the prefixes of its averagers: {sorted(found)}" if found else "it holds no averager"
            raise CheckpointError(
                f"{self.path} holds no averager saved with avg.sharded_state_dict(prefix={key!r}) ({held}, each found "
                f"by its {COUNTERS} entry): name one of them with --key, or leave --key out to merge the models"
            )
        return chosen

    def merged(self, key: str | None) -> tuple[dict[str, tuple[str, Any]], dict[str, int]]:
        """``{name: (key, stored)}`` a merge reads from the checkpoint, and ``{group: entries}`` it
        leaves out. By default the model's tensors, every averager left out under its ``group``;
        with ``key`` (``--key``), the averages of the averager saved under that prefix, named as the
        model's keys (a merge of averages is a model, never an averager to resume: its counters are
        left out by their key), the model's own tensors (``MODEL``) and any other averager left out."""
        left_out = Counter(self.left_out)
        if key is None:
            if not self.model:
                raise CheckpointError(
                    f"{self.path} holds no model tensor, only the averages of an averager (its prefixes: "
                    f"{[a.prefix for a in self.averagers]}, saved with avg.sharded_state_dict): a merge of the models "
                    "leaves an averager out; to merge its averages on purpose, name its prefix with --key"
                )
            left_out.update({averager.group: averager.entries for averager in self.averagers})
            return self.model, dict(sorted(left_out.items()))
        chosen = self.averager(key)
        left_out.update({a.group: a.entries for a in self.averagers if a is not chosen})
        left_out.update({MODEL: len(self.model), chosen.counters: 1, EXTRA_STATE: len(chosen.objects)})
        return chosen.averages(), dict(sorted((group, count) for group, count in left_out.items() if count))


def contents(folder: DcpFolder) -> Contents:
    """What the ``torch_dist`` checkpoint ``folder`` holds (``Contents``). An averager is found by
    its counters, then claims every entry under its prefix (the longest prefix first) but the
    training state Megatron keeps beside the model (``LEFT_OUT``); a pickled object no group names
    is left out by the name before its ``/shard_`` suffix, never read."""
    entries = {str(key): stored for key, stored in folder.metadata.state_dict_metadata.items()}
    prefixes = sorted(
        (key.removesuffix(COUNTERS) for key, stored in entries.items() if _is_counters(key, stored)),
        key=len,
        reverse=True,
    )
    owned: dict[str, tuple[dict[str, Any], list[str]]] = {prefix: ({}, []) for prefix in prefixes}
    model, objects, left_out = {}, [], Counter()
    for key, stored in entries.items():
        group = group_of(key)
        tensor = _is_tensor(stored)
        prefix = None if group in LEFT_OUT else next((p for p in prefixes if key.startswith(p)), None)
        if prefix is not None:
            tensors, owned_objects = owned[prefix]
            if tensor:
                tensors[key] = stored
            else:
                owned_objects.append(key)
        elif group is None and tensor:
            model[key] = (key, stored)
        else:
            group = group if group is not None else OBJECT_KEY.sub("", key)  # a pickled object of the model's
            left_out[group] += 1
            if group in CARRIED and not tensor:
                objects.append(key)
    if (folder.path / COMMON).is_file():
        left_out[COMMON] += 1
    if not model and not prefixes:
        raise CheckpointError(
            f"{folder.path} is a Megatron-Core torch_dist checkpoint holding no model tensor (only {sorted(left_out)})"
        )
    averagers = [Averager(prefix, tensors, tuple(found)) for prefix, (tensors, found) in owned.items()]
    return Contents(folder.path, model, averagers, objects, dict(sorted(left_out.items())))


def _is_tensor(stored: Any) -> bool:
    """Whether a DCP entry is a tensor (a table of chunks), not a pickled object's bytes."""
    return isinstance(getattr(stored, "chunks", None), list)


def _is_counters(key: str, stored: Any) -> bool:
    """Whether an entry is an averager's counters: its key ends in ``COUNTERS`` and it is the int64
    tensor of ``COUNTERS_SHAPE`` the averager writes there."""
    if not key.endswith(COUNTERS) or not _is_tensor(stored):
        return False
    dtype = getattr(getattr(stored, "properties", None), "dtype", None)
    return dtype == torch.int64 and tuple(getattr(stored, "size", ())) == COUNTERS_SHAPE


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
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None (absent, or ``release``).
    Anything but what Megatron-LM writes there (an iteration in ASCII digits, or ``release``) is
    refused in one line naming the file, as is a link out of the run: Megatron-LM itself refuses
    to resume from such a run, so no step of it can be told finished."""
    file = _within(run / TRACKER, run)
    if file is None:
        return None
    wrong = (
        f"{run / TRACKER} holds no iteration (Megatron-LM writes the newest finished iteration's number there, or "
        "'release'): write the iteration of the newest finished iter_* folder into it, or remove it"
    )
    try:
        text = read_bounded(file, SMALL_FILE, lambda size: CheckpointError(f"{wrong}; it is {size} bytes"))
        text = text.decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        raise CheckpointError(wrong) from None
    if not TRACKED.fullmatch(text):
        raise CheckpointError(wrong)
    return None if text == "release" else int(text)


def carried(folder: DcpFolder, averager: str | None = None) -> tuple[list[tuple[str, StoredBytes]], list[Path]]:
    """What a merge written as a DCP checkpoint carries from its newest ``torch_dist`` input for
    Megatron to load it: the objects its load asks for, where DCP stored them (``(key written, bytes
    located)``, each at most ``OBJECT_LIMIT``; copied a piece at a time by the writer, never held
    whole, never unpickled): the model's ``*._extra_state`` and the common state (``common_state``,
    where Megatron-Core 0.19 keeps it, reading ``common.pt`` only where that exists), and each
    averager's own objects, which go with its tensors (carried unchanged: ``Contents.averagers``); and
    its ``metadata.json`` and ``common.pt`` (copied byte for byte), each a regular file ``confined`` to
    the input. Where the merge is of the averages of the averager saved under the prefix ``averager``
    (``--key``), the output is a model: that averager's objects are carried under the model's keys
    (its prefix taken off) in place of the model's own. The optimizer and ``rng_state`` are not a
    merge's (load it with ``--no-load-optim --no-load-rng``, or ``--finetune``). Objects whose bytes
    overlap are refused naming both: each must be its own bytes of a part file, so what is carried is
    bounded by what the input's files hold, however many entries its ``.metadata`` lists (a crafted
    one listing one range N times would otherwise be written N times). Checked whole before anything
    is written."""
    held = contents(folder)
    if averager is None:
        keys = [(key, key) for key in held.objects] + [(key, key) for a in held.averagers for key in a.objects]
    else:
        chosen = held.averager(averager)
        common = [(key, key) for key in held.objects if group_of(key) != EXTRA_STATE]
        keys = common + [(key, key[len(chosen.prefix) :]) for key in chosen.objects]
    objects = [(written, StoredBytes(*folder.location(key, None, OBJECT_LIMIT))) for key, written in keys]
    _check_apart(objects)
    files = [folder.path / name for name in (METADATA, COMMON) if _within(folder.path / name, folder.path)]
    return objects, files


def _check_apart(objects: list[tuple[str, StoredBytes]]) -> None:
    """Refuse two objects whose bytes overlap in one file, naming both keys and the file."""
    reach: dict[Path, tuple[int, str]] = {}  # {file: (the end of the bytes seen so far, whose)}
    for key, stored in sorted(objects, key=lambda item: (item[1].file, item[1].start)):
        end, other = reach.get(stored.file, (0, ""))
        if stored.length and stored.start < end:
            raise CheckpointError(
                f"{stored.file}: the objects {other!r} and {key!r} are stored in the same bytes (from byte "
                f"{stored.start}); DCP stores each object once: this .metadata was crafted or damaged, merge a copy of "
                "the checkpoint as Megatron saved it"
            )
        if stored.start + stored.length > end:
            reach[stored.file] = (stored.start + stored.length, key)


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
