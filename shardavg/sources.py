"""The checkpoints ``shardavg merge`` reads: each one a set of named full tensors, read one at a time.

Four kinds are read in one process without a process group, whatever wrote them and at whatever
world size: an averager's checkpoint (``avg.save``, or an averager inside a DCP checkpoint:
``key=``), any average of it (``average=``); the plain tensors of a ``torch.distributed.checkpoint``
under a prefix (the main job's or torchtitan's ``model.`` entries); and a Hugging Face safetensors
model (one file, a folder with ``model.safetensors``, or sharded with an index). Nothing is
unpickled: DCP's metadata goes through the restricted unpickler, its items through
``torch.load(weights_only=True)``, safetensors through shardavg's checked reader. A DeepSpeed ZeRO
checkpoint is refused: its states are pickled Python objects.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .format import MANIFEST, STEP_DIR
from .offline import PLAIN_NAME, DcpFolder, SavedAverage, check_dcp
from .storage import DTYPES, SafetensorsFile

STEP_NAME = re.compile(r"^(?:step-|checkpoint-|global_step)(\d+)$")  # shardavg's, HF Trainer's, DeepSpeed's
RUN_MARKER = "train.json"  # a main-job checkpoint: its step, and every file's hash
DEEPSPEED_FILE = re.compile(r"^(?:zero_pp_rank_\d+_)?(?:mp_rank_\d+_)?(?:model|optim)_states\.pt$")


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
    an averager's checkpoint also knows each tensor's ``kinds`` (param or buffer) and ``roles``."""

    path: Path
    specs: dict[str, Spec]
    step: int | None
    described: dict[str, tuple[str, str]] = {}  # name: (kind, role), where the checkpoint says

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` on the CPU, in its saved dtype and shape."""

    def check(self) -> None:
        """Every tensor's location checked against the files, reading no tensor data."""

    def close(self) -> None:
        """Let go of open files."""

    def __str__(self) -> str:
        return str(self.path)


class AverageSource(Source):
    """An average of an averager's checkpoint (``avg.save``'s, or an averager in a DCP checkpoint);
    a tied tensor is offered under each of its names."""

    def __init__(self, path: Path, key: str, average: str | None) -> None:
        self.saved = SavedAverage(path, key=key)
        try:
            self.average = self.saved.average(average)
            if self.saved.description["num_updates"] == 0:
                raise CheckpointError(f"{self.saved.path} was saved before any update: it holds no average to merge")
        except BaseException:
            self.saved.close()
            raise
        self.path, self.step = self.saved.path, self.saved.description["step"]
        tensors = self.saved.description["tensors"]
        self.names = {alias: t["name"] for t in tensors for alias in (t["name"], *t["aliases"])}
        self.specs = {
            alias: Spec(DTYPES[t["dtype"]], tuple(t["shape"])) for t in tensors for alias in (t["name"], *t["aliases"])
        }
        self.described = {alias: (t["kind"], t["role"]) for t in tensors for alias in (t["name"], *t["aliases"])}

    def read(self, name: str) -> torch.Tensor:
        return self.saved.read(self.names[name], self.average)

    def check(self) -> None:
        self.saved.verify()

    def close(self) -> None:
        self.saved.close()


class DcpSource(Source):
    """The tensors of a DCP checkpoint under ``prefix`` (its model's, when the model and optimizer
    state dicts sit under ``model`` and ``optimizer``), named without the prefix."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path, self.folder, self.prefix = path, DcpFolder(path), prefix
        found = self.folder.tensors(prefix)
        if not found:
            entries = list(map(str, self.folder.metadata.state_dict_metadata))
            keys = sorted({name.split(".")[0] for name in entries})
            averagers = sorted(name.removesuffix(".meta") for name in entries if name.endswith(".meta"))
            hint = f"; averagers (merge one with --key): {averagers}" if averagers else ""
            raise CheckpointError(
                f"{path} holds no tensor under {prefix!r} (top-level keys: {keys}){hint}; pick one with --prefix"
            )
        self.specs = {
            key[len(prefix) :]: Spec(stored.properties.dtype, tuple(stored.size)) for key, stored in found.items()
        }
        self.step = _step_of(path)

    def read(self, name: str) -> torch.Tensor:
        return self.folder.read(self.prefix + name)

    def check(self) -> None:
        """Every item of the checkpoint in place (a truncated file is refused even where it holds no
        tensor merged), and the merged tensors' chunks boxes of them."""
        check_dcp(self.path)
        for name, spec in self.specs.items():
            self.folder.boxes(self.prefix + name, spec.shape, spec.dtype)


class SafetensorsSource(Source):
    """A Hugging Face model: one ``.safetensors`` file, or a folder holding one (or a sharded model
    and its ``*.safetensors.index.json``). Every file's header is checked when it is opened:
    a truncated or foreign file is refused before anything is merged."""

    def __init__(self, path: Path) -> None:
        self.path, self.files = path, []
        try:
            names = self._weight_map(path)
            self.files = [SafetensorsFile.open(file) for file in sorted(set(names.values()))]
            by_path = {Path(file.where): file for file in self.files}
            self.where = {name: by_path[file] for name, file in names.items()}
            self.specs = {}
            for name, file in self.where.items():
                stored = file.tensors.get(name)
                if stored is None:
                    raise CheckpointError(f"{file.where} lacks {name!r}, which the index places there")
                self.specs[name] = Spec(stored.dtype, stored.shape)
            self.step = self._step()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _weight_map(path: Path) -> dict[str, Path]:
        """Which file holds each tensor: the index's map, or every tensor of the one file."""
        if path.is_file():
            with SafetensorsFile.open(path) as file:
                return dict.fromkeys(file.tensors, path)
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(f"{path} holds several indexes {[p.name for p in indexes]}: name the model's file")
        if indexes:
            return _index(indexes[0])
        files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))
        if len(files) != 1:
            raise CheckpointError(f"{path} holds {len(files)} safetensors files and no index: name one of them")
        with SafetensorsFile.open(files[0]) as file:
            return dict.fromkeys(file.tensors, files[0])

    def _step(self) -> int | None:
        """The step a shardavg export recorded in its metadata, else the folder's name's."""
        recorded = self.files[0].metadata.get("shardavg") if self.files else None
        try:
            step = _a_step(json.loads(recorded).get("step")) if recorded else None
        except (ValueError, AttributeError):
            step = None
        return step if step is not None else _step_of(self.path if self.path.is_dir() else self.path.parent)

    def read(self, name: str) -> torch.Tensor:
        file = self.where[name]
        return file.read(name).view(self.specs[name].shape)

    def close(self) -> None:
        for file in self.files:
            file.close()


def _index(index: Path) -> dict[str, Path]:
    """A Hugging Face index's ``weight_map``, every file a plain name in the index's folder."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"cannot read {index}: {error}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and PLAIN_NAME.match(v) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names in its folder")
    missing = sorted({v for v in weight_map.values() if not (index.parent / v).is_file()})
    if missing:
        raise CheckpointError(f"{index} names files that are missing: {missing}")
    return {name: index.parent / file for name, file in weight_map.items()}


def _step_of(folder: Path) -> int | None:
    """The step a checkpoint folder's name gives (``step-N``, ``checkpoint-N``, ``global_stepN``),
    else the one a main-job checkpoint's ``train.json`` records."""
    match = STEP_NAME.match(folder.name)
    if match:
        return int(match.group(1))
    try:
        return _a_step(json.loads((folder / RUN_MARKER).read_text()).get("step"))
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None


def _a_step(value: object) -> int | None:
    """``value`` where it is a training step (an int >= 0), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _deepspeed_files(path: Path) -> list[str]:
    """DeepSpeed's state files in ``path`` or a tag folder below it (``global_step100/``)."""
    found = [p.name for p in path.glob("*_states.pt") if DEEPSPEED_FILE.match(p.name)]
    for tag in (p for p in path.iterdir() if p.is_dir()) if not found else ():
        found += [f"{tag.name}/{p.name}" for p in tag.glob("*_states.pt") if DEEPSPEED_FILE.match(p.name)]
    return sorted(found)


def open_source(path: str | Path, key: str | None = None, average: str | None = None, prefix: str = "model.") -> Source:
    """The checkpoint at ``path``, by what it holds: ``key`` picks an averager inside a DCP
    checkpoint, ``average`` one of an averager's averages, ``prefix`` a DCP checkpoint's tensors."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is a file but not a .safetensors one: merge reads no other single file")
        return SafetensorsSource(path)
    if (path / ".metadata").exists():
        return AverageSource(path, key, average) if key is not None else DcpSource(path, prefix)
    if (path / MANIFEST).exists() or any(STEP_DIR.match(p.name) and (p / MANIFEST).is_file() for p in path.iterdir()):
        return AverageSource(path, key or "ema", average)
    if any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")):
        return SafetensorsSource(path)
    deepspeed = _deepspeed_files(path)
    if deepspeed:
        averages = sorted(p.name for p in path.iterdir() if (p / MANIFEST).is_file())
        hint = f"; the averages beside it are shardavg checkpoints: merge {path / averages[0]}" if averages else ""
        raise CheckpointError(
            f"{path} is a DeepSpeed checkpoint ({deepspeed[0]}, ...): its states are pickled Python objects, which "
            "shardavg never loads (loading them runs code from the file), and they need DeepSpeed's own reader; "
            f"convert it once where you trust it (DeepSpeed's zero_to_fp32.py --safe_serialization) and merge the "
            f"safetensors it writes{hint}"
        )
    raise CheckpointError(
        f"{path} is not a checkpoint merge reads: no {MANIFEST} (shardavg), .metadata (DCP) or .safetensors "
        "file (Hugging Face) in it"
    )


def finished_checkpoints(run: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of a run folder's finished checkpoints, oldest first: its ``step-*``
    (or ``checkpoint-*``) folders, or those of its ``checkpoints/`` folder (the main job's). A
    folder a save is still writing (a hidden staging folder, a main-job folder without its
    ``train.json``, a DCP folder without ``.metadata``) is left out."""
    run = Path(run)
    if not run.is_dir():
        raise CheckpointError(f"{run} is not a folder of checkpoints")
    if (run / "checkpoints").is_dir() and not any(STEP_NAME.match(p.name) for p in run.iterdir()):
        run = run / "checkpoints"
    steps = {folder: STEP_NAME.match(folder.name) for folder in run.iterdir() if folder.is_dir()}
    steps = {folder: int(match.group(1)) for folder, match in steps.items() if match}
    main_job = any((folder / RUN_MARKER).is_file() for folder in steps)  # only committed folders carry it
    return sorted((step, folder) for folder, step in steps.items() if _finished(folder, main_job))


def _finished(folder: Path, main_job: bool) -> bool:
    if main_job:
        return (folder / RUN_MARKER).is_file()
    return any((folder / name).is_file() for name in (MANIFEST, ".metadata", "model.safetensors")) or any(
        folder.glob("*.safetensors.index.json")
    )
