"""One adapter per engine, and ``detect`` to pick the one that fits a model."""

from __future__ import annotations

from torch import nn

from ..errors import StrategyError
from .base import Strategy, TensorInfo, canonical_name, unwrap
from .fsdp1 import FSDP1
from .fsdp2 import FSDP2
from .replicated import Replicated
from .zero3 import Zero3

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (Zero3, FSDP1, FSDP2, Replicated)  # detection order
}


def detect(model: nn.Module) -> str:
    """Name of the adapter for ``model``: the first of zero3, fsdp1, fsdp2, replicated that fits."""
    return next(name for name, cls in STRATEGIES.items() if cls.fits(model))


SOURCES = ("live", "master")


def make_strategy(model: nn.Module, strategy: str = "auto", source: str = "live") -> Strategy:
    """Build the adapter ``strategy`` names (or the detected one for ``"auto"``), averaging the
    live weights, or with ``source="master"`` a DeepSpeed ZeRO-3 engine's fp32 master partitions."""
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
        if cls is not Zero3:
            raise StrategyError(
                f"source='master' averages the fp32 master partitions of a DeepSpeed ZeRO-3 engine; this model is "
                f"held the {strategy!r} way (ZeRO-1/2 masters are not supported yet): use source='live'"
            )
        return Zero3(model, master=True)
    return cls(model)


__all__ = [
    "STRATEGIES",
    "Strategy",
    "StrategyError",
    "TensorInfo",
    "canonical_name",
    "detect",
    "make_strategy",
    "unwrap",
]
