"""Errors shardavg raises on bad input; each message names the offending tensors or settings."""

from __future__ import annotations


class StrategyError(ValueError):
    """An unknown strategy name, or a strategy forced on a model it does not fit."""


class ModelChangedError(RuntimeError):
    """The model's tensors no longer match the ones the averager was built on."""


class NonFiniteError(FloatingPointError):
    """Live weights hold NaN or infinity; the average was left untouched."""


class LayoutError(RuntimeError):
    """Ranks disagree on the tracked tensors, or their shards do not tile a tensor."""


class CheckpointError(ValueError):
    """A checkpoint is missing, never committed, corrupt, not ours or of another model; the message names it."""


class ExportError(CheckpointError):
    """An export refused (its target is not a model folder of its own) or failed on a rank."""
