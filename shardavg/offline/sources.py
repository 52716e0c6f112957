"""The checkpoints ``shardavg merge`` reads: each one a set of named full tensors, read one at a time.

Four kinds are read in one process without a process group, whatever wrote them and at whatever
world size: an averager's checkpoint (``avg.save``, or an averager inside a DCP checkpoint:
``key=``), any average of it (``average=``); the model's tensors of a ``torch.distributed.checkpoint``
(under ``model.`` as the main job and torchtitan before 2025 write them, or at the top level as
current torchtitan and ``dcp.save(get_model_state_dict(model))`` do; optimizer, scheduler, data
loader and train state entries are never the model's); and a Hugging Face safetensors model (one
file, or a folder by Transformers' conventions: ``model.safetensors`` or its index). Nothing is
unpickled: DCP's metadata goes through the restricted unpickler, its items through
``torch.load(weights_only=True)``, safetensors through shardavg's checked reader. Megatron-Core's
``torch_dist`` checkpoints are DCP checkpoints (``megatron``); DeepSpeed's raw ZeRO tags and universal
checkpoints are read for their fp32 masters, with ``torch.load(weights_only=True)`` and the few
data-only types of DeepSpeed's named (``deepspeed_folders``). A known format that cannot be read is
refused in one line naming the command that converts it (Lightning's ``.ckpt``, an ``accelerate``
``save_state`` folder of pickles, a DeepSpeed tag holding other Python objects).
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CheckpointError
from ..base.links import confined, own_file
from ..base.untrusted import parse_json
from ..base.validate import is_count
from ..checkpoints.format import DCP_METADATA, MANIFEST, STEP_DIR, STEP_NAME, WEIGHTS_FILE
from ..checkpoints.storage import SafetensorsFile
from ..output.model_folder import weights_of
from ..output.record import FolderRecord
from ..output.weight_files import check_one_export
from . import deepspeed_folders, megatron
from .saved_average import PLAIN_NAME, DcpFolder, Rows, SavedAverage, check_dcp_items, rows_shape

RUN_MARKER = "train.json"  # a main-job checkpoint: its step, and every file's hash
MODEL_KEY = "model"  # the main job's, torchtitan's before 2025 and many trainers' key for the model state dict
# Top-level keys of training state beside the model in a DCP checkpoint, never the model's tensors
# (torchtitan's ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``, and their kin).
NOT_MODEL_KEYS = frozenset({
    "optimizer", "optimizers", "optim", "optim_state", "optimizer_state", "lr_scheduler", "lr_schedulers",
    "scheduler", "schedulers", "dataloader", "data_loader", "dataloaders", "train_state", "trainer_state",
    "training_state", "rng", "rng_state", "rng_states", "step", "epoch", "extra_state",
})  # fmt: skip
RUN_FOLDERS = ("checkpoints", "checkpoint")  # the main job's; torchtitan's
STATE_DICT = "['state_dict']"  # where a Lightning checkpoint keeps the model
ACCELERATE_FILES = ("random_states_0.pkl", "optimizer.bin", "scheduler.bin")  # beside its model


@dataclass(frozen=True)
class Spec:
    """What a tensor is: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {list(self.shape)}"


class Source(ABC):
    """A checkpoint opened for merging: ``specs`` (every tensor's name, dtype and shape, known
    before anything is read), ``step`` (its training step, when it records one) and ``read``;
    ``ties`` (groups of names it knows to be one tensor, stored once); an averager's checkpoint
    also knows each tensor's kind (param or buffer) and role, ``described``."""

    path: Path
    specs: dict[str, Spec]
    step: int | None
    run_id: str | None = None  # the run an averager's checkpoint records, if any
    ties: list[tuple[str, ...]] = []  # names of one tensor, stored once under the first
    left_out: dict[str, int] = {}  # entries of training state not merged: {where: how many tensors}
    described: dict[str, tuple[str, str]] = {}  # name: (kind, role), where the checkpoint says

    @abstractmethod
    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        """The full tensor ``name`` on the CPU, in its saved dtype and shape, or only its rows
        ``[start, stop)`` (reading no more of the files than holds them)."""

    def check(self) -> None:
        """Every tensor's location checked against the files, reading no tensor data."""

    def origins(self) -> frozenset[Path]:
        """Where its tensors are read from, every link followed: two inputs that share one are the
        same checkpoint named twice (a folder and its ``model.safetensors``, a link to it)."""
        return frozenset([self.path.resolve()])

    def close(self) -> None:
        """Let go of open files."""

    def __str__(self) -> str:
        return str(self.path)


class AverageSource(Source):
    """An average of an averager's checkpoint (``avg.save``'s, or an averager in a DCP checkpoint);
    a tied tensor is offered under its first name, its other names in ``ties``."""

    def __init__(self, path: Path, key: str, average: str | None) -> None:
        self.saved = SavedAverage(path, key=key)
        try:
            self.average = self.saved.average(average)
            if self.saved.description.num_updates == 0:
                raise CheckpointError(f"{self.saved.path} was saved before any update: it holds no average to merge")
        except BaseException:
            self.saved.close()
            raise
        self.path, self.step = self.saved.path, self.saved.description.step
        self.run_id = self.saved.description.run
        tensors = self.saved.description.tensors
        self.specs = {t.name: Spec(t.torch_dtype, t.shape) for t in tensors}
        self.ties = [t.names for t in tensors if t.aliases]
        self.described = {alias: (t.kind, t.role) for alias, t in self.saved.description.by_name().items()}

    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        return self.saved.read(name, self.average, rows)

    def check(self) -> None:
        self.saved.verify()

    def close(self) -> None:
        self.saved.close()


class DcpSource(Source):
    """The model's tensors of a DCP checkpoint, named as the model names them (see ``model_tensors``).

    A Megatron-Core ``torch_dist`` checkpoint names its own (``megatron.contents``): the model's tensors,
    the averagers saved beside them (``averagers``) left out by name; or, with ``key``, the averages of
    the averager saved under that prefix (``averaged``), named as the model's keys. Its ``kept``: the
    averagers' tensors (their counters among them) that a DCP output carries unchanged when this is
    the newest input, so that a run resuming from the merge restores that run's average, never a
    mean of averages with one input's counters (none when an averager is what is merged)."""

    averagers: list[megatron.Averager] = []
    averaged: megatron.Averager | None = None
    kept: dict[str, Any] = {}  # {key: stored}

    def __init__(self, path: Path, prefix: str | None, key: str | None = None) -> None:
        self.path, self.folder = path, DcpFolder(path)
        if megatron.is_torch_dist(path):
            self._megatron(prefix, key)
        else:
            self.keys, self.left_out = model_tensors(self.folder, prefix)
        self.specs = {
            name: Spec(stored.properties.dtype, tuple(stored.size)) for name, (_, stored) in self.keys.items()
        }
        self.step = _step_of(path)

    def _megatron(self, prefix: str | None, key: str | None) -> None:
        """The tensors of a ``torch_dist`` checkpoint, whose keys are the model's (no entry holds it):
        the model's, or with ``key`` an averager's averages (``megatron.Contents.merged``). A ``prefix``
        alone reads it as any DCP checkpoint, refused where it holds an averager, which that would
        merge as the model with one input's counters."""
        held = megatron.contents(self.folder)
        if prefix is not None and key is None:
            if held.averagers:
                raise CheckpointError(
                    f"{self.path} is a Megatron-Core checkpoint holding averagers (prefixes "
                    f"{[a.prefix for a in held.averagers]}): leave --prefix out to merge its model, or name an "
                    "averager's prefix with --key to merge its averages"
                )
            self.keys, self.left_out = model_tensors(self.folder, prefix)
            return
        self.keys, self.left_out = held.merged(key)
        self.averagers = held.averagers
        self.averaged = held.averager(key) if key is not None else None
        if self.averaged is None:
            self.kept = {k: stored for averager in held.averagers for k, stored in averager.tensors.items()}

    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        return self.folder.read(self.keys[name][0], rows)

    def output_key(self, name: str) -> str:
        """The key a DCP output writes the merged tensor ``name`` under: this input's, or, for an
        averager's averages, the model's key (its prefix taken off), so that Megatron loads the
        merge into the model."""
        return name if self.averaged is not None else self.keys[name][0]

    def check(self) -> None:
        """Every item of the checkpoint in place (a truncated file is refused even where it holds no
        tensor merged), and the merged and kept tensors' chunks boxes of them."""
        check_dcp_items(self.path, self.folder.metadata)  # (the metadata read once, when opened)
        for name, spec in self.specs.items():
            self.folder.boxes(self.keys[name][0], spec.shape, spec.dtype)
        for key, stored in self.kept.items():
            self.folder.boxes(key, tuple(stored.size), stored.properties.dtype)


def model_tensors(folder: DcpFolder, prefix: str | None = None) -> tuple[dict[str, tuple[str, Any]], dict[str, int]]:
    """``{name: (key, stored)}`` of the model's tensors in a DCP checkpoint, ``name`` as the model
    names it and ``key`` as DCP stores it; and how many tensors under each other entry were left out.

    Where the model is depends on the trainer that saved it, and DCP's metadata says how each
    entry was nested in the state dict saved (its ``planner_data``). With ``prefix=None`` the
    model is the ``model`` entry's tensors when there is one (the main job, torchtitan before
    2025, ``{"model": model_sd, "optimizer": ...}``), else the tensors saved at the top level
    (current torchtitan, ``dcp.save(get_model_state_dict(model))``), never an entry nested under
    another key (``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``, an averager).
    ``prefix`` names the entry holding the model (``"model."``, or ``"model"``: a prefix is whole
    components of the names, never a part of one); ``""`` is the top level.
    """
    entries = folder.metadata.state_dict_metadata
    tensors = {str(key): stored for key, stored in entries.items() if isinstance(getattr(stored, "chunks", None), list)}
    paths = _nesting(folder.metadata, tensors)
    averagers = {str(key).removesuffix(".meta") for key in entries if str(key).endswith(".meta")}
    if prefix is None:
        nested = any(len(path) > 1 and path[0] == MODEL_KEY for path in paths.values())
        prefix = f"{MODEL_KEY}." if nested else ""
    if prefix:
        prefix = prefix if prefix.endswith(".") else f"{prefix}."  # (``mod`` is ``mod.``, never ``model.``'s start)
        key = prefix.removesuffix(".")
        if key in NOT_MODEL_KEYS or key in averagers:
            what = "an averager (merge it with --key)" if key in averagers else "training state, not a model"
            raise CheckpointError(f"{folder.path}: {key!r} holds {what}: name the model's entry with --prefix")
        found = {k[len(prefix) :]: (k, stored) for k, stored in tensors.items() if k.startswith(prefix)}
    else:
        found = {
            k: (k, stored)
            for k, stored in tensors.items()
            if len(paths[k]) == 1 and k not in NOT_MODEL_KEYS and k.split(".")[0] not in averagers
        }
    merged = {key for key, _ in found.values()}
    left_out = Counter(str(paths[k][0]) for k in tensors if k not in merged)
    objects = {str(key): None for key in entries if str(key) not in tensors}  # pickled bytes: never read
    left_out.update(str(path[0]) for path in _nesting(folder.metadata, objects).values())
    if not found:
        groups = sorted({str(path[0]) for path in paths.values()})
        hint = f"; averagers (merge one with --key): {sorted(averagers)}" if averagers else ""
        where = f"under {prefix!r}" if prefix else "at the top level"
        raise CheckpointError(
            f"{folder.path} holds no model tensor {where} (its tensors are under {groups}){hint}; name the model's "
            "entry with --prefix"
        )
    return found, dict(sorted(left_out.items()))


def _nesting(metadata: Any, tensors: dict[str, Any]) -> dict[str, tuple]:
    """Each key's path in the state dict saved, from DCP's ``planner_data`` (its default
    planner records it when it flattens nested dicts); where a key is missing from it, the key
    split at its first dot (a top-level name has no dot to tell from a nested one there)."""
    recorded = getattr(metadata, "planner_data", None)
    recorded = recorded if isinstance(recorded, dict) else {}
    paths = {}
    for key in tensors:
        path = recorded.get(key)
        if isinstance(path, tuple) and path and all(isinstance(part, (str, int)) for part in path):
            paths[key] = tuple(path)
        else:
            head, _, rest = key.partition(".")
            paths[key] = (head, rest) if rest and head in NOT_MODEL_KEYS | {MODEL_KEY} else (key,)
    return paths


class SafetensorsSource(Source):
    """A Hugging Face model: one ``.safetensors`` file, or a folder holding one (or a sharded model
    and its ``*.safetensors.index.json``). Every file's header is checked when it is opened:
    a truncated or foreign file is refused before anything is merged. Links to regular files are
    followed within the input (the Hugging Face cache's snapshots link to its blobs: see
    ``confined``). ``model_dir``: the model folder (also of a file named that is its folder's
    weights); ``ties_embeddings``: its config ties the output embedding to the input one (which
    Transformers then saves once)."""

    def __init__(self, path: Path) -> None:
        self.path, self.files = path, []
        try:
            names, index = self._weight_map(path)
            self.real = {file: _real(file, path) for file in sorted(set(names.values()))}
            self.files = [SafetensorsFile.open(real, where=file) for file, real in self.real.items()]
            check_one_export(index + [(str(file.where), file.metadata) for file in self.files])  # (one export)
            by_path = {Path(file.where): file for file in self.files}
            self.where = {name: by_path[file] for name, file in names.items()}
            self.specs = {}
            for name, file in self.where.items():
                stored = file.tensors.get(name)
                if stored is None:
                    raise CheckpointError(f"{file.where} lacks {name!r}, which the index places there")
                self.specs[name] = Spec(stored.dtype, stored.shape)
            self.step = self._step()
            self.model_dir = path if path.is_dir() else _model_dir_of(path)
            self.ties_embeddings = self.model_dir is not None and _ties_embeddings(self.model_dir)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _weight_map(path: Path) -> tuple[dict[str, Path], list[tuple[str, Any]]]:
        """Which file holds each tensor: the index's map, or every tensor of the one file (a
        folder's by Transformers' conventions, see ``model_folder.weights_of``); and the index's
        ``(where, metadata)``, if there is one, for ``check_one_export``."""
        weights = path if path.is_file() else weights_of(path)
        if weights.name.endswith(".index.json"):
            _real(weights, path)
            weight_map, metadata = _index(weights)
            return weight_map, [(str(weights), metadata)]
        with SafetensorsFile.open(_real(weights, path), where=weights) as file:
            return dict.fromkeys(file.tensors, weights), []

    def origins(self) -> frozenset[Path]:
        return frozenset(self.real.values())

    def _step(self) -> int | None:
        """The step a shardavg export recorded in its weights' record, else the folder's name's."""
        record = FolderRecord.from_metadata(self.files[0].metadata, where=self.files[0].where) if self.files else None
        step = record.step if record is not None else None
        return step if step is not None else _step_of(self.path if self.path.is_dir() else self.path.parent)

    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        shape = self.specs[name].shape
        if rows is None:
            return self.where[name].read(name).view(shape)
        row = math.prod(shape[1:])
        return self.where[name].read(name, rows[0] * row, (rows[1] - rows[0]) * row).view(rows_shape(shape, rows))

    def close(self) -> None:
        for file in self.files:
            file.close()


class UniversalSource(Source):
    """The fp32 masters of a DeepSpeed universal checkpoint (``deepspeed_folders``), one
    ``zero/<name>/fp32.pt`` per parameter, memory-mapped, and at ZeRO-3 the buffers and frozen
    parameters its model states hold (``universal_states``: ``ds_to_universal`` writes them into
    ``zero/`` only at ZeRO-1/2); its optimizer moments (and at ZeRO-1/2 its pickled model states)
    are left out unread."""

    def __init__(self, path: Path) -> None:
        self.path, self.step = path, _step_of(path)
        self.files, self.left_out = deepspeed_folders.universal_masters(path)
        self.states = deepspeed_folders.universal_states(path)
        if self.states is None:  # (ZeRO-1/2: its model states' tensors are in ``zero/``)
            unread = len(deepspeed_folders.state_files(path))
            self.left_out |= {"model states": unread} if unread else {}
            self.shapes, kept = {}, {}
        else:
            self.shapes = {str(k): tuple(v) for group in self.states.param_groups() for k, v in group.items()}
            kept = self.states.specs
        self.specs = {}
        for name, file in self.files.items():
            master = deepspeed_folders.load_master(path, name, file, self.shapes)
            self.specs[name] = Spec(master.dtype, tuple(master.shape))
        for name, (dtype, shape) in kept.items():
            self.specs.setdefault(name, Spec(dtype, shape))  # (a tensor of its own in ``zero/`` is read there)

    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        if name not in self.files:  # (a buffer or frozen parameter: read whole, as a raw tag's are)
            whole = self.states.read(name)  # type: ignore[union-attr]
            return whole if rows is None else whole[rows[0] : rows[1]].clone()
        master, spec = deepspeed_folders.load_master(self.path, name, self.files[name], self.shapes), self.specs[name]
        if master.dtype != spec.dtype or tuple(master.shape) != spec.shape:
            raise CheckpointError(
                f"{self.files[name]} changed during the merge: {spec} before, now {master.dtype} {list(master.shape)}"
            )
        part = master if rows is None else master[rows[0] : rows[1]]
        return torch.empty(rows_shape(spec.shape, rows), dtype=spec.dtype).copy_(part)  # (never the mapped file's)


class RawZeroSource(Source):
    """The fp32 masters of a raw DeepSpeed ZeRO-1/2/3 tag (``deepspeed_folders.RawZero``), with its
    buffers and frozen parameters; a parameter DeepSpeed saved once for several names is offered
    under its first name, its others in ``ties``."""

    def __init__(self, path: Path) -> None:
        self.path, self.step = path, _step_of(path)
        self.zero = deepspeed_folders.RawZero(path)
        self.specs = {name: Spec(dtype, shape) for name, (dtype, shape) in self.zero.specs.items()}
        self.ties, self.left_out = self.zero.ties, self.zero.left_out

    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        whole = self.zero.read(name)  # (a parameter's elements lie across the ranks' partitions: read whole)
        return whole if rows is None else whole[rows[0] : rows[1]].clone()


def _real(file: Path, given: Path) -> Path:
    """Where the file ``file`` of the input ``given`` lies: the file named itself wherever it links
    (the user chose it), any other ``confined`` to its folder."""
    if file == given:
        return file.resolve()
    return confined(file, given if given.is_dir() else given.parent)


def _model_dir_of(file: Path) -> Path | None:
    """The model folder a safetensors file named alone belongs to: its folder, where that folder
    holds a ``config.json`` and this file is its weights (a file among others is alone)."""
    folder = file.parent
    try:
        return folder if (folder / "config.json").is_file() and weights_of(folder).resolve() == file.resolve() else None
    except CheckpointError:
        return None


def _ties_embeddings(folder: Path) -> bool:
    """Whether the model's ``config.json`` ties its output embedding to its input embedding
    (Transformers' default when the config leaves it out); False where the folder has no config."""
    config = _json_beside(folder, "config.json")
    return isinstance(config, dict) and config.get("tie_word_embeddings", True) is not False


def _json_beside(folder: Path, name: str) -> Any:
    """The JSON file ``name`` of the input ``folder``, or None where it is missing or not JSON; a
    link out of the folder is refused (``own_file``), never read."""
    if not os.path.lexists(folder / name):
        return None
    try:
        return parse_json(own_file(folder / name, folder, "refused").read_text(), folder / name)
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _index(index: Path) -> tuple[dict[str, Path], Any]:
    """A Hugging Face index's ``weight_map``, every file a plain name in the index's folder, and its ``metadata``."""
    try:
        content = parse_json(index.read_text(), index)
        weight_map, metadata = content.get("weight_map"), content.get("metadata")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"cannot read {index}: {error}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and PLAIN_NAME.match(v) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names in its folder")
    missing = sorted({v for v in weight_map.values() if not (index.parent / v).is_file()})
    if missing:
        raise CheckpointError(f"{index} names files that are missing: {missing}")
    return {name: index.parent / file for name, file in weight_map.items()}, metadata


def _step_of(folder: Path) -> int | None:
    """The step a checkpoint folder's name gives (``step-N``, ``checkpoint-N``, ``global_stepN``, ``iter_N``),
    else the one a main-job checkpoint's ``train.json`` records."""
    match = STEP_NAME.match(folder.name)
    if match:
        return int(match.group(1))
    if megatron.iteration_of(folder) is not None:
        return megatron.iteration_of(folder)
    tag = deepspeed_folders.TAG.match(folder.name)  # (``global_step100_universal``)
    if tag:
        return int(tag.group(1))
    marker = _json_beside(folder, RUN_MARKER)
    return _a_step(marker.get("step")) if isinstance(marker, dict) else None


def _a_step(value: object) -> int | None:
    """``value`` where it is a training step (an int >= 0), else None."""
    return value if is_count(value) else None


def open_source(
    path: str | Path, key: str | None = None, average: str | None = None, prefix: str | None = None
) -> Source:
    """The checkpoint at ``path``, by what it holds: ``key`` picks an averager inside a DCP
    checkpoint (in a Megatron-Core one, the prefix it was saved under), ``average`` one of an
    averager's averages, ``prefix`` the entry of a DCP checkpoint that holds the model (default:
    found, see ``model_tensors``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_file():
        if path.suffix == ".ckpt":
            raise CheckpointError(
                f"{path} is a Lightning checkpoint (.ckpt), a pickle, which shardavg never loads; convert it once "
                f"where you trust it: {_to_safetensors(path, STATE_DICT, weights_only=False)}, and merge that file"
            )
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is a file but not a .safetensors one: merge reads no other single file")
        return SafetensorsSource(path)
    if (path / DCP_METADATA).exists():
        if key is not None and not megatron.is_torch_dist(path):
            return AverageSource(path, key, average)
        if average is not None and key is not None:
            raise CheckpointError(
                f"{path} is a Megatron-Core checkpoint, which holds one average under each averager's prefix: name "
                f"the prefix of the average to merge with --key, without --average {average}"
            )
        return DcpSource(path, prefix, key)
    if (path / MANIFEST).exists() or any(STEP_DIR.match(p.name) and (p / MANIFEST).is_file() for p in path.iterdir()):
        return AverageSource(path, key or "ema", average)
    if deepspeed_folders.is_universal(path):
        return UniversalSource(path)
    if (
        any(path.glob("*.safetensors"))
        or any(path.glob("*.safetensors.index.json"))
        or (path / "config.json").is_file()
    ):
        return SafetensorsSource(path)
    _refuse_accelerate(path)
    refused = megatron.refusal(path)
    if refused is not None:
        raise refused
    deepspeed = deepspeed_folders.state_files(path)
    if deepspeed and "/" not in deepspeed[0]:  # (a tag: its states are in it)
        try:
            return RawZeroSource(path)
        except CheckpointError as error:
            raise deepspeed_folders.refuse_raw(path, deepspeed, str(error)) from None
    if deepspeed:
        averages = sorted(p.name for p in path.iterdir() if (p / MANIFEST).is_file())
        hint = f"; the averages beside it are shardavg checkpoints: merge {path / averages[0]}" if averages else ""
        raise CheckpointError(
            f"{path} is a DeepSpeed checkpoint ({deepspeed[0]}, ...), a run folder of several saves: merge its "
            f"tags by name ({path / deepspeed[0].split('/')[0]}), or its newest K with --last K {path}{hint}"
        )
    raise CheckpointError(
        f"{path} is not a checkpoint merge reads: no {MANIFEST} (shardavg), .metadata (DCP) or .safetensors "
        "file (Hugging Face) in it"
    )


def _refuse_accelerate(path: Path) -> None:
    """Refuse an ``accelerator.save_state`` folder that holds no safetensors model, naming what works:
    its FSDP model's DCP folder, or its pickled model converted (a plain state dict, which
    ``torch.load``'s default ``weights_only=True`` reads)."""
    if not any((path / name).is_file() for name in ACCELERATE_FILES):
        return
    sharded = sorted(p for p in path.glob("pytorch_model_fsdp_*") if (p / DCP_METADATA).is_file())
    if sharded:
        raise CheckpointError(f"{path} is an accelerate save_state folder of an FSDP model: merge its {sharded[0]}")
    pickled = path / "pytorch_model.bin"
    if pickled.is_file():
        raise CheckpointError(
            f"{path} is an accelerate save_state folder saved with safe_serialization=False ({pickled.name}, a pickle, "
            f"which shardavg never loads); convert it once: {_to_safetensors(pickled, '', weights_only=True)}, and "
            "merge the folder"
        )
    raise CheckpointError(f"{path} is an accelerate save_state folder without its model's weights: nothing to merge")


def _to_safetensors(pickled: Path, entry: str, weights_only: bool) -> str:
    """A one-line command that writes the state dict ``torch.load(pickled)`` (its ``entry``) as
    safetensors beside it."""
    out = pickled.with_name("model.safetensors")
    return (
        f'python -c "import torch; from safetensors.torch import save_file; save_file({{k: v.contiguous() for k, v '
        f"in torch.load('{pickled}', weights_only={weights_only}){entry}.items()}}, '{out}')\""
    )


def finished_checkpoints(run: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of a run folder's finished checkpoints, oldest first: its ``step-*``
    (or ``checkpoint-*``) folders, or those of its ``checkpoints/`` folder (the main job's) or
    ``checkpoint/`` folder (torchtitan's); a Megatron-LM run's ``iter_*`` folders, a DeepSpeed run's
    ``global_stepN`` tags (``megatron.finished_iterations``, ``deepspeed_folders.finished_tags``).
    A folder a save is still writing (a hidden staging folder, a main-job folder without its
    ``train.json``, a DCP folder without ``.metadata``, an iteration or tag newer than the one
    the run's tracker file names) is left out. The run folder may be a link (the user named it), and
    so may a checkpoint folder in it while it stays within the folder that lists it (``confined``):
    one that leads elsewhere is another run's, refused by name."""
    run = Path(run)
    if not run.is_dir():
        raise CheckpointError(f"{run} is not a folder of checkpoints")
    found = megatron.finished_iterations(run)
    found = deepspeed_folders.finished_tags(run) if found is None else found
    found = _run_folders(run) if found is None else found
    for _, folder in found:
        if folder.is_symlink():  # (a folder itself lies within the folder listing it)
            confined(folder, folder.parent)
    return found


def _run_folders(run: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of a main-job, torchtitan or Trainer run folder's finished checkpoints (see
    ``finished_checkpoints``)."""
    if not any(STEP_NAME.match(p.name) for p in run.iterdir()):
        run = next((run / name for name in RUN_FOLDERS if (run / name).is_dir()), run)
    steps = {folder: STEP_NAME.match(folder.name) for folder in run.iterdir() if folder.is_dir()}
    steps = {folder: int(match.group(1)) for folder, match in steps.items() if match}
    main_job = any((folder / RUN_MARKER).is_file() for folder in steps)  # only committed folders carry it
    return sorted((step, folder) for folder, step in steps.items() if _finished(folder, main_job))


def _finished(folder: Path, main_job: bool) -> bool:
    if main_job:
        return (folder / RUN_MARKER).is_file()
    return any((folder / name).is_file() for name in (MANIFEST, DCP_METADATA, WEIGHTS_FILE)) or any(
        folder.glob("*.safetensors.index.json")
    )
