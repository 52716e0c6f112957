"""One adapter per engine, and ``detect`` to pick the one that fits a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..errors import StrategyError
from .base import ModuleStrategy, Strategy, TensorInfo, canonical_name, unwrap
from .fsdp1 import FSDP1
from .fsdp2 import FSDP2
from .pipeline import Pipeline
from .replicated import Replicated
from .zero3 import Zero3
from .zero12 import Zero12Master

# The adapters ``strategy=`` names, in detection order; ZeRO-1/2 masters are reached by source="master" only.
STRATEGIES: dict[str, type[ModuleStrategy]] = {cls.name: cls for cls in (Zero3, FSDP1, FSDP2, Replicated)}
ADAPTERS = frozenset({*STRATEGIES, Zero12Master.name})  # every name a saved description may carry


def detect(model: nn.Module) -> str:
    """Name of the adapter for ``model``: the first of zero3, fsdp1, fsdp2, replicated that fits."""
    return next(name for name, cls in STRATEGIES.items() if cls.fits(model))


SOURCES = ("live", "master")


def make_strategy(
    model: nn.Module | Sequence[nn.Module], strategy: str = "auto", source: str = "live", pipeline: Any = None
) -> Strategy:
    """Build the adapter ``strategy`` names (or the detected one for ``"auto"``), averaging the
    live weights, or with ``source="master"`` a DeepSpeed engine's fp32 masters (ZeRO-1, 2 or 3).
    With ``pipeline`` (the pipeline's process group or mesh), ``model`` is this rank's stage, or
    a list of its stages, and the averager covers every stage's tensors (``pipeline.py``)."""
    if pipeline is not None:
        parts = list(model) if isinstance(model, (list, tuple)) else [model]
        if not parts or not all(isinstance(part, nn.Module) for part in parts):
            raise StrategyError(f"with pipeline=..., pass this rank's stage module or a list of them, got {model!r}")
        return Pipeline([make_strategy(part, strategy, source) for part in parts], pipeline)
    if isinstance(model, (list, tuple)):
        raise StrategyError(
            "a list of model parts is a pipeline's stages: pass pipeline=<the pipeline's process group or mesh>"
        )
    if source not in SOURCES:
        raise StrategyError(f"unknown source {source!r}; expected one of {SOURCES}")
    if strategy == "auto":
        strategy = detect(model)
    if strategy not in STRATEGIES:
        raise StrategyError(f"unknown strategy {strategy!r}; expected 'auto' or one of {sorted(STRATEGIES)}")
    cls = STRATEGIES[strategy]
    if not cls.fits(model):
        raise StrategyError(
            f"strategy {strategy!r} does not fit this {type(model).__name__}: "
            f"its parameters are held the {detect(model)!r} way"
        )
    if source == "master":
        if cls is Zero3:
            return Zero3(model, master=True)
        if Zero12Master.fits(model):
            return Zero12Master(model)
        raise StrategyError(
            f"source='master' averages the fp32 master weights of a DeepSpeed engine (ZeRO-1, 2 or 3, passed as "
            f"the engine deepspeed.initialize returned); this model is held the {strategy!r} way: use source='live'"
        )
    return cls(model)


__all__ = [
    "ADAPTERS",
    "STRATEGIES",
    "ModuleStrategy",
    "Pipeline",
    "Strategy",
    "StrategyError",
    "TensorInfo",
    "canonical_name",
    "detect",
    "make_strategy",
    "unwrap",
]
