"""Real text every machine has: the Python standard library's own ``.py`` sources, as bytes.

Files are split into train and held-out *by file* with a fixed seed, so no held-out line is
ever trained on. A batch is a function of (seed, step, rank) alone: resuming at step N reads
exactly what an uninterrupted run reads at step N, with no loader state to save.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 bytes
    heldout: torch.Tensor
    source: str  # what was read, for the log
    files: tuple[int, int]  # train files, held-out files


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, without whatever is installed into it.

    A walk that never enters the skipped folders: ``rglob`` went through the interpreter's own
    ``site-packages`` too (here 43,000 of its 51,000 files), half a second on every rank of every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in skip]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(path for path in found if path.is_file())


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or every regular file under it (no links, pipes or devices), in a fixed order."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
        if not files:
            raise ValueError(f"{path} holds no regular file to train on")
        return files
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    raise ValueError(f"{path} is neither a regular file nor a folder (a pipe or a device?)")


def head(file: Path, size: int) -> bytes:
    """At most the first ``size`` bytes of ``file``: never more is read, however large it is."""
    with open(file, "rb") as handle:
        return handle.read(size)


def load_corpus(path: str | None, heldout_fraction: float, max_bytes: int, seed: int, context: int) -> Corpus:
    """The train and held-out text: ``max_bytes`` at most, read and kept. ValueError or OSError,
    naming the file, when it cannot serve one window of ``context`` bytes for each part."""
    files = stdlib_sources() if path is None else text_files(Path(path))
    source = f"the Python {sysconfig.get_python_version()} standard library" if path is None else str(path)
    if len(files) == 1:  # one file: the held-out part is its tail
        data = head(files[0], max_bytes)
        cut = int(len(data) * (1 - heldout_fraction))
        train, heldout, counts = data[:cut], data[cut:], (1, 1)
    else:
        random.Random(seed).shuffle(files)
        held = max(1, round(len(files) * heldout_fraction))
        train = _read(files[held:], int(max_bytes * (1 - heldout_fraction)))
        heldout = _read(files[:held], max_bytes - len(train))
        counts = (len(files) - held, held)
    for name, part in (("train", train), ("held-out", heldout)):
        if len(part) <= context + 1:
            raise ValueError(f"{source}: the {name} text has {len(part)} bytes, fewer than one window of {context}")
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(heldout), source, counts)


def _read(files: list[Path], budget: int) -> bytes:
    """Whole files, in order, until ``budget`` bytes (the last one cut)."""
    parts, size = [], 0
    for file in files:
        if size >= budget:
            break
        data = head(file, budget - size)
        parts.append(data)
        size += len(data)
    return b"\n".join(parts)


def windows(tokens: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets for windows beginning at ``starts``."""
    index = starts[:, None] + torch.arange(context + 1)
    chunk = tokens[index].long()
    return chunk[:, :-1], chunk[:, 1:]


def train_batch(
    tokens: torch.Tensor, step: int, rank: int, batch_size: int, context: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step``: random windows drawn from a generator seeded by (seed, step, rank)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 4_099 + rank)
    starts = torch.randint(len(tokens) - context - 1, (batch_size,), generator=generator)
    return windows(tokens, starts, context)


def heldout_batches(
    tokens: torch.Tensor, rank: int, world: int, batches: int, batch_size: int, context: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed evaluation set, evenly spaced over the held-out text, split across ranks."""
    count = batches * batch_size * world
    starts = torch.linspace(0, len(tokens) - context - 2, count).long()
    mine = starts[rank::world]
    return [windows(tokens, chunk, context) for chunk in mine.split(batch_size)]
