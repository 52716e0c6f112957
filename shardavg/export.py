"""Consolidated export: the full averaged model as safetensors, in the Hugging Face layout, or
as a state dict on rank 0 (``full_state_dict``) or in a plain module on every rank (``copy_to``).

Tensors arrive one at a time (gathered by the averager, or read from a checkpoint by the
offline CLI) and are streamed to disk as they come, so the writer holds one tensor at a time.
A model above ``max_shard_size`` is split into ``model-00001-of-0000N.safetensors`` files
with a ``model.safetensors.index.json``; otherwise it is one ``model.safetensors``. Files
already in the directory stay, unless they are weight files of an earlier shardavg export.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from . import validate
from .dist import agree_or_raise, rank
from .errors import ExportError
from .ownership import INDEX_FILE, MANIFEST, TargetLock, enclosing_checkpoint, export_files, target_path
from .state import AverageState
from .storage import Entry, atomic_file, commit_file, discard_staged, dtype_name, write_safetensors

SINGLE_FILE = "model.safetensors"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``5GB`` (10**9, as Hugging Face counts), ``500MiB`` (2**20) or a plain int."""
    if isinstance(size, int) and not isinstance(size, bool) and 0 < size <= 2**62:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size)[:100], flags=re.IGNORECASE)
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()] if match else 0.0
    if not 1 <= value <= 2**62:  # also refuses an overflow to infinity
        raise ValueError(f"max_shard_size must be a positive size up to 4 EiB, like 5GB or 500MiB, got {size!r}")
    return int(value)


def plan_files(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Split entries, in order, into files of at most ``max_bytes`` (a larger tensor gets a file alone)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _check_target(directory: Path) -> dict[str, bool]:
    """Refuse a target that is a file, a checkpoint or inside one, or holds weight files shardavg
    did not write; return the weight files it holds, each with whether it is shardavg's own."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ExportError(f"{directory} exists and is not a directory: shardavg will not replace it")
    if (directory / MANIFEST).exists() or (directory / ".metadata").exists():
        raise ExportError(f"{directory} is a checkpoint: export into a model folder of its own")
    enclosing = enclosing_checkpoint(directory)
    if enclosing is not None:
        raise ExportError(
            f"{directory} is inside the checkpoint {enclosing}, which holds only its own files: export into a "
            "model folder of its own"
        )
    present = export_files(directory)
    foreign = sorted(name for name, own in present.items() if not own)
    if foreign:
        raise ExportError(
            f"{directory} holds weight files shardavg did not write ({', '.join(foreign)}): they would be "
            "replaced; export into another directory, or move them"
        )
    return present


def write_model(
    directory: str | os.PathLike,
    entries: list[Entry],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str],
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``tensors`` (one per entry, in order) as safetensors weight files into ``directory``.

    Other files there (a Hugging Face ``config.json``, a tokenizer) stay untouched. Every weight
    file is written complete under its temporary name before any of them replaces the previous
    export's (a failure while writing, an fp16 overflow found on the way, leaves the previous
    export whole); then they are moved into place, the index last (the switch of a split model),
    and the previous export's other weight files are removed.
    """
    directory = target_path(directory, "export", replaced_whole=False)
    files = plan_files(entries, parse_size(max_shard_size))
    names = (
        [SINGLE_FILE]
        if len(files) == 1
        else [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    )
    _check_target(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    held = written = False
    try:
        with TargetLock.inside(directory):
            held = True
            previous = _check_target(directory)
            stream: Iterator[torch.Tensor] = iter(tensors)
            try:
                for name, planned in zip(names, files):
                    pieces = itertools.islice(stream, len(planned))
                    write_safetensors(directory / name, planned, pieces, metadata, staged=True)
            except BaseException:
                for name in names:
                    discard_staged(directory / name)
                raise
            for name in names:
                commit_file(directory / name)
            if len(files) > 1:
                index = {
                    "metadata": {"total_size": sum(e.nbytes for e in entries), "shardavg": metadata["shardavg"]},
                    "weight_map": {entry.key: name for name, planned in zip(names, files) for entry in planned},
                }
                with atomic_file(directory / INDEX_FILE) as handle:
                    handle.write(json.dumps(index, indent=1).encode())
            written = True
            for stale in set(previous) - set(names) - ({INDEX_FILE} if len(files) > 1 else set()):
                (directory / stale).unlink(missing_ok=True)
    finally:
        if created and held and not written:  # leave no half export in a directory this call made
            for name in names:
                (directory / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: another writer's files are there
                directory.rmdir()
    return directory


def export_metadata(description: dict, average: str | None, live: bool = False) -> dict[str, str]:
    """What goes into every file's ``__metadata__`` (safetensors wants strings): which average
    (its name and rule; or the live weights), after how many steps and updates, from which engine."""
    rules = {entry["name"]: entry["rule"] for entry in description["averages"]}
    keep = ("step", "num_updates", "strategy", "world_size")
    which = {"weights": "live"} if live else {"average": average, "rule": rules[average]}
    content = which | {key: description.get(key) for key in keep}
    return {"format": "pt", "shardavg": json.dumps(content)}


def export_entries(
    tensors: Iterable[tuple[list[str], torch.dtype, tuple[int, ...]]], dtype: torch.dtype | None
) -> list[Entry]:
    """One entry per name (tied weights are written under each of their names), cast to ``dtype``."""
    return [Entry(name, cast_dtype(saved, dtype), shape) for names, saved, shape in tensors for name in names]


def cast_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """Floating tensors take the export dtype; integer ones keep theirs."""
    return dtype if dtype is not None and saved.is_floating_point else saved


def cast(tensor: torch.Tensor, dtype: torch.dtype | None, name: str) -> torch.Tensor:
    """``tensor`` in ``dtype`` (floating tensors; integer ones as they are), refused where a finite
    value overflows it (an fp16 output beyond 65,504 would be written as inf)."""
    target = cast_dtype(tensor.dtype, dtype)
    if target == tensor.dtype:
        return tensor
    out = tensor.to(target)
    if torch.finfo(target).max < torch.finfo(tensor.dtype).max:
        overflowed = torch.isinf(out) & torch.isfinite(tensor)
        if overflowed.any():
            largest = tensor[overflowed].abs().max().item()
            raise ExportError(
                f"{name}: {int(overflowed.sum())} values overflow {dtype_name(target)} (largest magnitude "
                f"{largest:.6g}; {dtype_name(target)} holds up to {torch.finfo(target).max:.6g}): write it in "
                "bfloat16 or float32"
            )
    return out


def export(
    state: AverageState,
    path: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    average: str | None = None,
    live: bool = False,
) -> Path:
    """Collective: gather ``average`` (or the live weights) tensor by tensor and write it on rank 0
    (see ``write_model``)."""
    max_bytes = parse_size(max_shard_size)
    path = target_path(path, "export", replaced_whole=False)
    validate.floating_dtype("dtype", dtype)
    name = None if live else state.average(average).name
    gathered = state.gathered(dst=0, average=name, live=live)  # checks the averager before anything is written
    pieces = (state.piece(i, name, live) for i in range(len(state.infos)))
    entries = export_entries(
        ((list(info.names), piece.dtype, tuple(info.shape)) for info, piece in zip(state.infos, pieces)), dtype
    )
    error: BaseException | None = None
    if rank() == 0:

        def tensors() -> Iterator[torch.Tensor]:
            for info, full in gathered:
                full = cast(full, dtype, info.names[0]).to("cpu")  # type: ignore[arg-type]
                for _ in info.names:
                    yield full
                del full  # before the next tensor is gathered

        stream = tensors()
        try:
            write_model(path, entries, stream, export_metadata(state.describe(), name, live), max_bytes)
        except Exception as caught:
            error = caught
        for _ in stream:  # finish the collective gather even if writing failed
            pass
    else:
        for _ in gathered:
            pass
    agree_or_raise(error, f"exporting to {path}", ExportError)
    return Path(path)


def full_state_dict(state: AverageState, average: str | None, live: bool = False) -> dict[str, torch.Tensor]:
    """Collective: on rank 0 ``{name: full tensor}`` on CPU (every name of a tied tensor), ``{}`` elsewhere."""
    result: dict[str, torch.Tensor] = {}
    for info, full in state.gathered(dst=0, average=average, live=live):
        if full is not None:
            full = full.cpu()
            for name in info.names:
                result[name] = full
    return result


def copy_to(state: AverageState, module: nn.Module, average: str | None) -> None:
    """Collective: write ``average`` into the plain ``module`` on every rank, the owners' values."""
    state.average(average)  # a wrong name is refused before anything else
    target = module.state_dict(keep_vars=True)
    expected = {name: info.shape for info in state.infos for name in info.names}
    missing = sorted(set(expected) - set(target))
    unexpected = sorted(set(target) - set(expected))
    misshaped = sorted(
        f"{name}: {tuple(target[name].shape)} vs {tuple(shape)}"
        for name, shape in expected.items()
        if name in target and target[name].shape != shape
    )
    if missing or unexpected or misshaped:
        raise ValueError(
            f"copy_to(): {type(module).__name__} does not match the averaged model: missing {missing}, "
            f"unexpected {unexpected}, mis-shaped {misshaped}"
        )
    with torch.no_grad():
        for info, full in state.gathered(dst=None, average=average):
            for name in info.names:
                target[name].copy_(full)
