"""What a saved averager is, everything but its tensors' values, as typed values: the counters,
the averages and their rules, the options, and one entry per tensor.

The live state describes itself with these (``AverageState.describe``, in ``averager/``); the
on-disk format beside it (``format.py``: ``check_description``, ``parse_manifest``) checks and
parses what a file holds into them, and writes them back through ``to_json``. They are plain data,
with no live state behind them: every reader and writer of files (``checkpoints``, ``output``,
``offline``) knows a saved averager by its description alone."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..base.dtypes import DTYPES
from ..layouts.tensor_info import TensorKind
from ..layouts.tensor_layout import TensorLayout
from ..update.options import Options, Role

FORMAT, VERSION = "shardavg", 6  # the description's format, shared by checkpoints, DCP and exports
# (2: checksummed; 3: "averages", several named averages, in place of one "rule"; 4: a checkpoint's
# manifest records its save's id and every file's size and SHA-256; 5: chunks are boxes of the
# tensor, not ranges of the flattened tensor, and DCP holds each tensor in its own shape; 6: a
# manifest gives each tensor's layout over the ranks, and the grids of ranks once, not its chunks)
CHECKSUM = "checksum"


def tensor_key(average: str | None, name: str) -> str:
    """The key a tensor of an average is saved under: its name, prefixed by the average's name for
    averaged tensors of a named average (``"slow/fc.weight"``)."""
    return name if average is None else f"{average}/{name}"


@dataclass(frozen=True)
class FileDigest:
    """A written file's size and SHA-256, recorded so that a reader can tell it is the same file."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a description: its name and tied aliases, parameter or buffer, its role, its
    shape and stored dtype; in a manifest also where it lies across the files (``layout``)."""

    name: str
    aliases: tuple[str, ...]
    kind: TensorKind
    role: Role
    shape: tuple[int, ...]
    dtype: str
    layout: TensorLayout | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "kind": self.kind,
            "role": self.role,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class DescribedAverage:
    """One average of a description: its name (``None`` for an averager's one unnamed average) and
    its rule's ``to_json()`` (a custom rule: ``{"kind": "custom", "name": ...}``), checked by
    ``Rule.from_json`` when read."""

    name: str | None
    rule: dict[str, Any]


@dataclass(frozen=True)
class Description:
    """What a saved averager is, everything but the tensors' values: counters, averages, options
    and one entry per tensor. A manifest (``avg.save``) adds its files, their digests, its save's
    id and sequence number, and each entry's layout. ``format.check_description`` (one parser
    for every reader: a manifest, DCP's entry, an export's metadata) checks it whole and builds it;
    ``to_json`` writes it in this version's format, checksummed. (The parser is not a
    ``from_json`` here: it needs the layouts and rules the format knows, and this module is what
    the format imports.)"""

    step: int
    num_updates: int
    num_skipped: int
    averages: tuple[DescribedAverage, ...]
    tensors: tuple[TensorEntry, ...]
    strategy: str | None = None  # None: written before version 2 recorded it
    world_size: int | None = None
    options: Options | None = None  # None: before version 2; read back, those not recorded are at their defaults
    run: str | None = None  # the run that wrote it (a PostHocEMA's run id), when it had one
    provenance: dict[str, Any] | None = None  # what a merge records of its inputs
    version: int = VERSION
    checksum: str | None = None
    sequence: int | None = None  # a manifest's, from here on
    save_id: str | None = None
    files: tuple[str, ...] = ()
    digests: tuple[FileDigest, ...] = ()

    @property
    def average_names(self) -> list[str | None]:
        return [average.name for average in self.averages]

    def rule(self, average: str | None) -> dict[str, Any]:
        """The rule config of ``average`` (one of ``average_names``)."""
        return next(a.rule for a in self.averages if a.name == average)

    def by_name(self) -> dict[str, TensorEntry]:
        """Every tensor under each of its names (a tied tensor's aliases too)."""
        return {name: entry for entry in self.tensors for name in entry.names}

    def to_json(self) -> dict[str, Any]:
        """The description as JSON-able data with its checksum (the manifest's fields left out:
        ``manifest_json`` adds them)."""
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "num_updates": self.num_updates,
            "num_skipped": self.num_skipped,
            "averages": [{"name": a.name, "rule": a.rule} for a in self.averages],
            "strategy": self.strategy,
            "world_size": self.world_size,
            "options": None if self.options is None else self.options.to_json(),
            **({} if self.run is None else {"run": self.run}),
            **({} if self.provenance is None else {"provenance": self.provenance}),
            "tensors": [entry.to_json() for entry in self.tensors],
        }
        return with_checksum(meta)


def checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of the description without its checksum, in one canonical JSON spelling."""
    content = {key: value for key, value in meta.items() if key != CHECKSUM}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def with_checksum(meta: dict[str, Any]) -> dict[str, Any]:
    return meta | {CHECKSUM: checksum(meta)}
