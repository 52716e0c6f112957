"""Errors shardavg raises on bad input; each message names the offending tensors or settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class StrategyError(ValueError):
    """An unknown strategy or source, or a strategy forced on a model it does not fit.

    Also raised for tensors an engine holds in a way shardavg cannot read (a ``Partial`` DTensor,
    ZeRO++ or NVMe offload). A ``ValueError``: raised when a ``WeightAverager`` is built.
    """


class ModelChangedError(RuntimeError):
    """The model's tensors no longer match the ones the averager was built on.

    Raised before the averager swaps, gathers, saves or loads; build a new averager for the new model.
    """


class NonFiniteError(FloatingPointError):
    """Live weights hold NaN or infinity; the average was left untouched.

    Raised by ``update()`` (or at the next call, for an update in the background) under
    ``on_nonfinite="raise"``; the message names the tensors.
    """


class LayoutError(RuntimeError):
    """Ranks disagree on the tracked tensors, or their shards do not tile a tensor.

    Raised when a ``WeightAverager`` is built (a collective, so on every rank).
    """


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure as every rank learns it: its exception's type name and message.

    An exception cannot cross processes whole (its traceback holds frames, its arguments need not
    pickle, and shardavg sends other ranks only plain data), so the failing rank sends these two
    strings and every rank keeps them. ``str()`` gives ``"TypeName: message"``.
    """

    type_name: str
    message: str

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class CheckpointError(ValueError):
    """A checkpoint is missing, never committed, corrupt, not ours or of another model; the message names it.

    Also raised when a write is refused (something not shardavg's in the way, another process
    writing there). A ``ValueError``.

    Where the ranks agree on a failure before collective I/O (a save's commit, a load, an export
    written by every rank), the error is raised on every rank and ``failures`` maps each failing
    rank to its ``RankFailure`` (the same mapping on every rank, as torch DCP's
    ``CheckpointException.failures`` maps ranks to their exceptions); the message says the same in
    words. ``failures`` is empty for an error of this process alone.
    """

    def __init__(self, *args: object, failures: Mapping[int, RankFailure] | None = None) -> None:
        super().__init__(*args)
        self.failures: dict[int, RankFailure] = dict(failures or {})


class ProvenanceError(CheckpointError):
    """A ``provenance.json`` (or a manifest's ``"provenance"``) that is not a record shardavg wrote:
    unreadable, too large, nested too deeply, or a field of the wrong type; the message names the file.

    A ``CheckpointError``, so ``except CheckpointError`` catches it too.
    """


class ExportError(CheckpointError):
    """An export refused (its target is not a model folder of its own) or failed on a rank.

    A ``CheckpointError``, so ``except CheckpointError`` catches it too.
    """
