"""DeepSpeed's checkpoints, as ``engine.save_checkpoint`` and ``ds_to_universal`` write them.

A run folder holds one tag folder per save (``global_stepN``) and ``latest``, the tag of the
newest finished save (written after it). A raw tag holds each rank's flat fp32 partitions in its
``*_optim_states.pt``, a pickle of plain containers, tensors and three data-only types of
DeepSpeed's, which ``torch.load(weights_only=True)`` reads with stand-ins for those three
(``DATA_ONLY``, never DeepSpeed's code): the masters are rebuilt from them as DeepSpeed's
``zero_to_fp32.py`` rebuilds them (``RawZero``). A tag holding any other type is refused, naming
that script, the conversion that works there. A universal checkpoint (``ds_to_universal``'s
``global_stepN_universal/``) holds each parameter's fp32 master in ``zero/<name>/fp32.pt``: at
ZeRO-1/2 ``{'param': tensor, 'cat_dim': ...}`` in the parameter's shape; at ZeRO-3 a flat tensor,
shaped by the model states' ``param_shapes``. Buffers and frozen parameters have no optimizer
master: DeepSpeed keeps them in the model states (``ModelStates``), and ``ds_to_universal`` writes
them into ``zero/`` at ZeRO-1/2 but not at ZeRO-3, whose per-rank model states it copies beside
``zero/``: they are read from there. Its optimizer moments (``exp_avg.pt``, ``exp_avg_sq.pt``,
``optimizer_state.pt``) are left out unread. Every file read goes through ``links.own_file``: a link
leaving the checkpoint (``zero/w/fp32.pt``, or the whole ``zero/w/``, linked to another run's) is
refused by name.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..base.errors import CheckpointError
from ..base.links import own_file
from .saved_average import PLAIN_NAME

ZERO = "zero"  # a universal checkpoint's folder of parameters
MASTER = "fp32.pt"  # a parameter's fp32 master in it
LATEST = ("latest", "latest_universal")  # the newest finished tag of a run folder (raw, universal)
TAG = re.compile(r"^global_step(\d+)(_universal)?$")  # a save of step N, converted to universal or not
STATE_FILE = re.compile(r"^(?:zero_pp_rank_\d+_)?(?:mp_rank_\d+_)?(?:model|optim)_states\.pt$")
TENSOR_LIMIT = 2**40  # (bytes) no parameter's file is larger; a larger claim is damage


def state_files(path: Path) -> list[str]:
    """DeepSpeed's pickled state files in ``path`` or a tag folder below it (``global_step100/``)."""
    found = [p.name for p in path.glob("*_states.pt") if STATE_FILE.match(p.name)]
    for tag in (p for p in path.iterdir() if p.is_dir()) if not found else ():
        found += [f"{tag.name}/{p.name}" for p in tag.glob("*_states.pt") if STATE_FILE.match(p.name)]
    return sorted(found)


def is_universal(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed universal checkpoint (a ``zero/`` folder of parameter folders)."""
    return (path / ZERO).is_dir() and any((p / MASTER).is_file() for p in (path / ZERO).iterdir())


def conversion(path: Path) -> str:
    """The one command that converts the raw DeepSpeed save ``path`` (a tag or its run folder) into
    safetensors: DeepSpeed's ``zero_to_fp32.py``, which it copies into every run folder."""
    tag = path if TAG.match(path.name) or not (path / "latest").is_file() else None
    run = path.parent if tag is not None else path
    raw = tag.name.removesuffix("_universal") if tag is not None else None
    script = run / "zero_to_fp32.py"
    script = str(script) if script.is_file() else "zero_to_fp32.py"
    pick = f" --tag {raw}" if raw else ""
    return f"python {script} {run} {run / ((raw or 'latest') + '_fp32')}{pick} --safe_serialization"


def refuse_raw(path: Path, files: list[str], reason: str) -> CheckpointError:
    """The refusal of a raw ZeRO tag that cannot be read as data (``reason``), in one line, naming the
    conversion that works."""
    return CheckpointError(
        f"{path} is a DeepSpeed checkpoint ({files[0]}, ...), raw ZeRO, which cannot be read as data ({reason}); "
        f"convert it once where you trust it: {conversion(path)}, and merge the folder it writes"
    )


def _load(file: Path, folder: Path) -> Any:
    """A file of the checkpoint ``folder`` (``own_file``: a link out of it refused), memory-mapped,
    with ``torch.load(weights_only=True)``."""
    real = own_file(file, folder, "refused")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(real, weights_only=True, mmap=True)
    except Exception as error:  # (weights_only refuses any Python object: never unpickled)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"cannot read {file} with torch.load(weights_only=True): {first}") from None


def universal_masters(path: Path) -> tuple[dict[str, Path], dict[str, int]]:
    """``{name: fp32.pt}`` of a universal checkpoint's parameters, and ``{group: files}`` of what is
    left out unread: the optimizer moments and ``optimizer_state.pt``."""
    files, moments = {}, 0
    for folder in sorted(p for p in (path / ZERO).iterdir() if p.is_dir()):
        if not PLAIN_NAME.match(folder.name) or not (folder / MASTER).is_file():
            raise CheckpointError(f"{folder} holds no {MASTER}: not a parameter of a universal checkpoint")
        files[folder.name] = folder / MASTER
        moments += sum(1 for p in folder.glob("*.pt") if p.name != MASTER)
    if not files:
        raise CheckpointError(f"{path / ZERO} holds no parameter: not a DeepSpeed universal checkpoint")
    counts = {"optimizer moments": moments, "optimizer_state.pt": int((path / ZERO / "optimizer_state.pt").is_file())}
    return files, {group: count for group, count in counts.items() if count}


def universal_states(path: Path) -> ModelStates | None:
    """The model states of a ZeRO-3 universal checkpoint (one file per rank, copied by ``ds_to_universal``
    from the raw save): its parameters' shapes, buffers and frozen parameters. None at ZeRO-1/2 (one
    file, whose tensors ``ds_to_universal`` wrote into ``zero/``) or where they cannot be read as data
    (``load_master`` then says what works); a link out of the checkpoint is refused all the same."""
    files = _model_files(path)
    if not files or not all(MODEL_FILE.match(file.name).group(1) for file in files):  # type: ignore[union-attr]
        return None
    for file in files:
        own_file(file, path, "refused")  # (refused, never taken for a file that cannot be read as data)
    try:
        return ModelStates(path, files, stage3=True)
    except CheckpointError:
        return None


def load_master(path: Path, name: str, file: Path, shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """Parameter ``name``'s fp32 master from its ``file`` of the universal checkpoint ``path``,
    memory-mapped: ZeRO-1/2 store it whole, in a dict; ZeRO-3 flat, its shape in ``shapes`` (its
    ``universal_states``: refused, naming what works, where they lack it)."""
    loaded = _load(file, path)
    value = loaded.get("param") if isinstance(loaded, dict) else loaded
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{file} holds {type(value).__name__}, not a parameter's tensor")
    if value.numel() * value.element_size() > TENSOR_LIMIT:
        raise CheckpointError(f"{file}: {name} {list(value.shape)} is larger than any parameter: refused")
    if isinstance(loaded, dict):
        return value
    shape = shapes.get(name)
    if shape is None:
        raise CheckpointError(
            f"{path} is a DeepSpeed universal checkpoint of ZeRO-3 whose model states do not give {name}'s shape as "
            f"data ({file} holds it flattened): merge the raw save it was made from instead, or convert that: "
            f"{conversion(path)}, and merge the folder it writes"
        )
    if value.dim() != 1 or value.numel() < math.prod(shape):
        raise CheckpointError(f"{file} holds {list(value.shape)}, not {name} flattened ({list(shape)})")
    return value[: math.prod(shape)].view(shape)


class _Record:
    """Stands in for a data-only object of DeepSpeed's in its optimizer states (``LossScaler``,
    ``fragment_address``): its fields are set, none of its code runs, and nothing here reads it."""


class _Stage(int):
    """Stands in for DeepSpeed's ``ZeroStageEnum``, an int enum: the stage's number."""


# DeepSpeed's data-only types in a raw ZeRO tag's ``*_optim_states.pt`` (measured on DeepSpeed 0.19.8: its
# model states need none), each read as a stand-in by ``torch.load(weights_only=True)``; any other refused.
DATA_ONLY = [
    (_Record, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def _model_files(path: Path) -> list[Path]:
    """A tag's model states, in rank order: one file at ZeRO-1/2, one per rank at ZeRO-3."""
    ranks = {p: MODEL_FILE.match(p.name) for p in path.iterdir()}
    found = {p: int(m.group(1) or 0) for p, m in ranks.items() if m}
    return sorted(found, key=found.__getitem__)


class ModelStates:
    """What a tag's model states hold beside the optimizer's masters, read as ``zero_to_fp32.py``
    restores it: the parameters' shapes (``param_groups``), the buffers (whole in ``module``, the
    floating ones in fp32) and the frozen parameters (``frozen_param_fragments``: whole at ZeRO-1/2,
    a flat part in each rank's file at ZeRO-3), every file read with ``torch.load(weights_only=True)``
    (DeepSpeed's model states hold none of its own types) and memory-mapped.

    ``specs``: ``{name: (dtype, shape)}`` of the buffers and frozen parameters."""

    def __init__(self, path: Path, files: list[Path], stage3: bool) -> None:
        self.path, self.stage3 = path, stage3
        self.states = [_load(file, path) for file in files]
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._buffers: list[str] = []
        first = self.states[0]
        for name, shape in dict(_get(first, "frozen_param_shapes", files[0]) or {}).items():
            self.specs[name] = (self._frozen_part(first, name).dtype, tuple(shape))
        module = _get(first, "module", files[0]) or {}
        for name in _get(first, "buffer_names", files[0]) or []:
            value = module.get(name)
            if isinstance(value, torch.Tensor):
                self.specs[name] = (torch.float32 if value.is_floating_point() else value.dtype, tuple(value.shape))
                self._buffers.append(name)

    def param_groups(self) -> list[dict[str, Any]]:
        """The trained parameters' ``{name: shape}``, one dict per optimizer group."""
        shapes = _get(self.states[0], "param_shapes", self.path)
        groups = shapes if isinstance(shapes, list) else [shapes]
        if not all(isinstance(group, dict) for group in groups):
            raise CheckpointError(f"{self.path}: its model states' param_shapes are not maps of names to shapes")
        return [dict(group) for group in groups]

    def read(self, name: str) -> torch.Tensor:
        """The whole buffer or frozen parameter ``name``, copied out of the mapped files."""
        dtype, shape = self.specs[name]
        if name in self._buffers:
            flat = _get(self.states[0], "module", self.path)[name].reshape(-1)
            flat = flat.float() if flat.is_floating_point() else flat
        else:
            parts = [self._frozen_part(state, name).reshape(-1) for state in self.states]
            flat = torch.cat(parts)[: math.prod(shape)] if self.stage3 else parts[0]
        return _shaped(flat, name, dtype, shape, self.path)

    def _frozen_part(self, state: Any, name: str) -> torch.Tensor:
        parts = _get(state, "frozen_param_fragments", self.path) or {}
        if not isinstance(parts.get(name), torch.Tensor):
            raise CheckpointError(f"{self.path} lacks the frozen parameter {name!r} its shapes list")
        return parts[name]


class RawZero:
    """The fp32 masters of a raw ZeRO-1/2/3 tag (``engine.save_checkpoint``'s folder), rebuilt as
    DeepSpeed's ``zero_to_fp32.py`` rebuilds them, from the ranks' flat partitions, every file read
    with ``torch.load(weights_only=True)`` (its optimizer states with ``DATA_ONLY``) and memory-mapped:
    a tensor's read copies only its own elements. Buffers and frozen parameters come from the model
    states (``ModelStates``); parameters DeepSpeed saved once for several names (``shared_params``)
    are ``ties``.

    ``specs``: ``{name: (dtype, shape)}``; ``where``: where each master lies (see ``_place_masters``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        models, optims = self._files(path)
        with torch.serialization.safe_globals(DATA_ONLY):
            states = [_load(file, path) for file in optims]
        self.optim = [_get(state, "optimizer_state_dict", file) for state, file in zip(states, optims)]
        self.stage = int(_get(self.optim[0], "zero_stage", optims[0]))
        self.ranks = len(optims)
        self.model = ModelStates(path, models, self.stage == 3)
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.where: dict[str, tuple] = {}
        self._place_masters(optims[0])
        self.specs |= self.model.specs
        shared = _get(self.model.states[0], "shared_params", models[0]) or {}
        self.ties = [(str(owner), str(name)) for name, owner in dict(shared).items() if owner in self.specs]
        moments = sum(1 for state in self.optim for _ in _tensors(state)) - sum(len(f) for f in self._flat)
        self.left_out = {"optimizer states": moments} if moments else {}

    @staticmethod
    def _files(path: Path) -> tuple[list[Path], list[Path]]:
        """The tag's model states (one, or one per rank at ZeRO-3) and its ranks' optimizer states, in
        rank order; refused where tensor or pipeline parallelism split the model (several ``mp_rank``)."""
        optims = {int(m.group(1)): p for p in path.iterdir() if (m := OPTIM_FILE.match(p.name)) and m.group(2) == "00"}
        models = _model_files(path)
        split = {m.group(2) for p in path.iterdir() if (m := OPTIM_FILE.match(p.name) or MODEL_FILE.match(p.name))}
        if len(split) > 1:
            raise CheckpointError(
                f"{path} holds a model split by tensor or pipeline parallelism (mp_rank {sorted(split)}): convert it "
                f"to a universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal --input_folder {path} "
                f"--output_folder {path}_universal) where its trainer supports that, else merge its zero_to_fp32 output"
            )
        if not optims or sorted(optims) != list(range(len(optims))) or not models:
            raise CheckpointError(f"{path} lacks some ranks' optimizer or model states (found {sorted(optims)})")
        return models, [optims[r] for r in range(len(optims))]

    def _place_masters(self, where: Path) -> None:
        """Where each trained parameter's master lies in the ranks' flat fp32 partitions, as
        ``zero_to_fp32.py`` finds it, with its checks that the shapes use the partitions up. ZeRO-1/2:
        each group's partitions, concatenated, hold its parameters one after another (each followed by
        its alignment padding, where recorded); ZeRO-3: every parameter split evenly over the ranks
        (padded to a multiple of them), one after another."""
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        self._flat = [list(_get(state, key, where)) for state in self.optim]
        groups = self.model.param_groups()
        paddings = self.optim[0].get("param_alignment_paddings") if self.stage != 3 else None
        offset = 0
        for group, names in enumerate(groups):
            padding = list(paddings[group]) if paddings is not None else [0] * len(names)
            offset = 0 if self.stage != 3 else offset
            for (name, shape), pad in zip(names.items(), padding):
                shape = tuple(shape)
                numel = math.prod(shape)
                self.where[name] = ("zero3", offset) if self.stage == 3 else ("zero12", group, offset)
                self.specs[name] = (torch.float32, shape)
                offset += -(-numel // self.ranks) if self.stage == 3 else numel + pad
            if self.stage != 3:
                held = sum(flat[group].numel() for flat in self._flat)
                align = 2 * self.ranks  # (ZeRO-2 pads each group to a multiple of twice the ranks)
                if -(-offset // align) != -(-held // align):
                    raise CheckpointError(
                        f"{self.path}: group {group}'s parameters use {offset} of its {held} elements"
                    )
        held = sum(t.numel() for t in self._flat[0])
        if self.stage == 3 and offset != held:
            raise CheckpointError(f"{self.path}: its parameters use {offset} of each rank's {held} elements")

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, copied out of the mapped files."""
        if name not in self.where:
            return self.model.read(name)
        dtype, shape = self.specs[name]
        numel = math.prod(shape)
        place = self.where[name]
        if place[0] == "zero12":
            _, group, offset = place
            flat = _flat_range([state[group] for state in self._flat], offset, numel)
        else:
            part = -(-numel // self.ranks)
            flat = torch.cat([_flat_range(groups, place[1], part) for groups in self._flat])[:numel]
        return _shaped(flat, name, dtype, shape, self.path)


def _shaped(flat: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...], where: Path) -> torch.Tensor:
    """The flat elements read for ``name``, checked to be its ``dtype`` and ``shape``, copied out of the mapped file."""
    if flat.numel() != math.prod(shape) or flat.dtype != dtype:
        raise CheckpointError(
            f"{where}: {name} holds {flat.numel()} {flat.dtype} elements, expected {math.prod(shape)} {dtype}"
        )
    return flat.clone().view(shape)


def _flat_range(parts: list[torch.Tensor], start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start + count)`` of the flat tensors ``parts`` laid end to end (never concatenated)."""
    pieces, base = [], 0
    for part in parts:
        part = part.reshape(-1)
        low, high = max(start, base), min(start + count, base + part.numel())
        if high > low:
            pieces.append(part[low - base : high - base])
        base += part.numel()
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=parts[0].dtype if parts else torch.float32)


def _get(state: Any, key: str, where: Path) -> Any:
    if not isinstance(state, dict) or key not in state:
        raise CheckpointError(f"{where} lacks {key!r}: not a DeepSpeed ZeRO checkpoint this reads")
    return state[key]


def _tensors(value: Any) -> Any:
    """Every tensor in a nest of dicts and lists."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def finished_tags(run: Path) -> list[tuple[int, Path]] | None:
    """``(step, folder)`` of a DeepSpeed run folder's finished saves, oldest first, or None where
    ``run`` is not one (no ``global_stepN`` folder of DeepSpeed's). A tag is finished up to the
    step its ``latest`` (or ``latest_universal``) names, when the run has one; a step saved both
    raw and converted to universal is its raw tag (the save itself)."""
    tags: dict[int, Path] = {}
    for folder in sorted(run.iterdir()):
        match = TAG.match(folder.name)
        if match and folder.is_dir() and (is_universal(folder) or state_files(folder)):
            step = int(match.group(1))
            if not match.group(2) or step not in tags:  # (the raw save it came from, when both are there)
                tags[step] = folder
    if not tags:
        return None
    newest = [_tag_step(run / name) for name in LATEST if (run / name).is_file()]
    newest = [step for step in newest if step is not None]
    top = max(newest) if newest else None
    return sorted((step, folder) for step, folder in tags.items() if top is None or step <= top)


def _tag_step(file: Path) -> int | None:
    """The step of the tag a ``latest`` file names, or None; a link out of its run folder is refused."""
    real = own_file(file, file.parent, "refused")
    try:
        with open(real, "rb") as handle:
            match = TAG.match(handle.read(256).decode().strip())  # (a tag's name, never a large file's)
    except (OSError, UnicodeDecodeError):
        return None
    return int(match.group(1)) if match else None
