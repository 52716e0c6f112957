"""The record of how a model folder was made: one typed value, written once and parsed once.

Every writer of a model folder (``avg.export``, ``shardavg export``, ``shardavg posthoc``,
``shardavg merge``) describes what it writes as a ``FolderRecord``; the weight files' plan puts
``to_metadata()`` into every file's ``__metadata__`` (and the index's), and the provenance goes
beside the weights as ``provenance.json`` (``provenance_file()``), never into them, so the weight
files stay the same bytes whoever wrote them. Everything that reads a folder's record back (the
step a merge input was taken at, the files an earlier merge carried, whether a weight file is
shardavg's) goes through ``from_metadata``.

The metadata's JSON is the one shardavg has always written (the same keys in the same order), so
folders already on disk read as before: an export's ``{"average", "rule", "step", "num_updates",
"strategy", "world_size"}`` (``{"weights": "live", ...}`` for the live weights; after 0.9 with
the averager's ``"options"``), a post-hoc
synthesis's ``{"posthoc": {"sigma_rel", "step"}}``, a merge's ``{"merge": [inputs], "step",
"carried"}``; a field that is missing or of another type reads as unknown (None, empty).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..base.errors import CheckpointError
from ..base.untrusted import parse_json
from ..base.validate import is_count
from ..checkpoints.description import Description
from .provenance import FILE as PROVENANCE

EXPORT_ID = "export_id"  # the metadata key of an export's id, in every weight file and the index
OWNER = "shardavg"  # the metadata key that makes a weight file shardavg's: the record's JSON
Made = Literal["export", "posthoc", "merge"]


@dataclass(frozen=True)
class MergedInput:
    """One input of a merge, as the weights' metadata name it: where, its step, its weight."""

    input: str
    step: int | None
    weight: float | None


@dataclass(frozen=True)
class FolderRecord:
    """How a model folder was made. ``made`` says by what; the other fields are those its writer knows.

    Attributes:
        made: ``"export"`` (an averager's, or a checkpoint's), ``"posthoc"`` or ``"merge"``.
        step: the training step the weights are of (a merge: its newest input's; None: unknown).
        average: an export's average (None: the averager's only one); ``live``: the live weights.
        rule: an export's averaging rule, as the averager describes it.
        num_updates: the updates an export's average holds.
        strategy: the engine an export was taken from; ``world_size``: at how many ranks.
        options: the averager's options (``Options.to_json()``; None: not recorded, as by 0.9 and earlier).
        sigma_rel: a post-hoc synthesis's profile width; ``until``: the step it was asked for.
        inputs: a merge's inputs; ``carried``: the files it carried beside the weights.
        provenance: the record written beside the weights (``provenance.json``), checked.
        export_id: the id the writer gave its files (set where the record is read back).
    """

    made: Made
    step: int | None = None
    average: str | None = None
    live: bool = False
    rule: dict[str, Any] | None = None
    num_updates: int | None = None
    strategy: str | None = None
    world_size: int | None = None
    options: dict[str, Any] | None = None
    sigma_rel: float | None = None
    until: int | None = None
    inputs: tuple[MergedInput, ...] = ()
    carried: tuple[str, ...] = ()
    provenance: dict[str, Any] | None = None
    export_id: str | None = None

    @classmethod
    def of_average(
        cls, description: Description, average: str | None, live: bool, provenance: dict[str, Any]
    ) -> FolderRecord:
        """The record of an export of ``average`` (or the ``live`` weights) of the averager
        ``description`` describes (in a process group, or saved in a checkpoint)."""
        return cls(
            "export",
            description.step,
            average=None if live else average,
            live=live,
            rule=None if live else description.rule(average),
            num_updates=description.num_updates,
            strategy=description.strategy,
            world_size=description.world_size,
            options=None if description.options is None else description.options.to_json(),
            provenance=provenance,
        )

    def to_metadata(self) -> dict[str, str]:
        """What goes into every weight file's ``__metadata__`` (safetensors wants strings)."""
        return {"format": "pt", OWNER: json.dumps(self._content())}

    def _content(self) -> dict[str, Any]:
        if self.made == "posthoc":
            return {"posthoc": {"sigma_rel": self.sigma_rel, "step": self.until}}
        if self.made == "merge":
            merged = [{"input": i.input, "step": i.step, "weight": i.weight} for i in self.inputs]
            return {"merge": merged, "step": self.step, "carried": list(self.carried)}
        which = {"weights": "live"} if self.live else {"average": self.average, "rule": self.rule}
        counters = {
            "step": self.step,
            "num_updates": self.num_updates,
            "strategy": self.strategy,
            "world_size": self.world_size,
        }
        return which | counters | ({} if self.options is None else {"options": self.options})

    def provenance_file(self) -> dict[str, bytes]:
        """The provenance as the ``provenance.json`` written beside the weights (name: bytes; none
        without one): staged with them, so that nothing in its way is found only after they were
        committed."""
        return {} if self.provenance is None else {PROVENANCE: json.dumps(self.provenance, indent=1).encode()}

    @classmethod
    def from_metadata(
        cls, metadata: Any, provenance: dict[str, Any] | None = None, where: str | os.PathLike = "a weight file"
    ) -> FolderRecord | None:
        """The record in a weight file's ``__metadata__`` (or a split model's index's ``"metadata"``),
        with ``provenance`` read from beside the weights; None where it holds none (weights not
        shardavg's). What cannot be read is unknown: a record older than a field, or damaged. A
        record nested deeper than ``JSON_DEPTH`` is refused instead (a ``CheckpointError`` naming
        ``where``, the file it came from), never parsed into a ``RecursionError``."""
        if not isinstance(metadata, Mapping) or OWNER not in metadata:
            return None
        try:
            content = parse_json(metadata[OWNER], f"the shardavg record in {where}")
        except CheckpointError:
            raise
        except (TypeError, ValueError):
            content = None
        content = content if isinstance(content, dict) else {}
        export_id = metadata.get(EXPORT_ID)
        kept = {"provenance": provenance, "export_id": export_id if isinstance(export_id, str) else None}
        if isinstance(content.get("posthoc"), dict):
            posthoc = content["posthoc"]
            return cls("posthoc", sigma_rel=_number(posthoc.get("sigma_rel")), until=_step(posthoc.get("step")), **kept)
        if isinstance(content.get("merge"), list):
            inputs = tuple(_merged_input(found) for found in content["merge"] if isinstance(found, dict))
            carried = content.get("carried")
            names = tuple(name for name in carried if isinstance(name, str)) if isinstance(carried, list) else ()
            return cls("merge", _step(content.get("step")), inputs=inputs, carried=names, **kept)
        return cls(
            "export",
            _step(content.get("step")),
            average=_text(content.get("average")),
            live=content.get("weights") == "live",
            rule=content["rule"] if isinstance(content.get("rule"), dict) else None,
            num_updates=_step(content.get("num_updates")),
            strategy=_text(content.get("strategy")),
            world_size=_step(content.get("world_size")),
            options=content["options"] if isinstance(content.get("options"), dict) else None,
            **kept,
        )


def _merged_input(found: dict[str, Any]) -> MergedInput:
    return MergedInput(str(found.get("input")), _step(found.get("step")), _number(found.get("weight")))


def _step(value: Any) -> int | None:
    """``value`` where it is a count (an int >= 0: a step, a number of updates), else None."""
    return value if is_count(value) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
