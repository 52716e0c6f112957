"""One strategy per engine, and ``detect`` to pick the one that fits a model.

It may import: base, layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..base.errors import StrategyError
from .base import ModuleStrategy, Strategy, TensorInfo, canonical_name, unwrap
from .fsdp1 import FSDP1
from .fsdp2 import FSDP2
from .megatron import Megatron, is_megatron, megatron_strategy
from .pipeline import Pipeline
from .replicated import Replicated, refuse_non_replicas, refuse_unlike_values
from .zero3 import Zero3
from .zero12 import Zero12Master

# The strategies ``strategy=`` names, in detection order; ZeRO-1/2 masters are reached by source="master" only.
STRATEGIES: dict[str, type[ModuleStrategy]] = {cls.name: cls for cls in (Megatron, Zero3, FSDP1, FSDP2, Replicated)}
SAVED_STRATEGIES = frozenset({*STRATEGIES, Zero12Master.name})  # every name a saved description may carry


def detect(model: nn.Module) -> str:
    """Name the strategy that fits ``model``: what ``WeightAverager(strategy="auto")`` picks.

    The first of ``"megatron"``, ``"zero3"``, ``"fsdp1"``, ``"fsdp2"``, ``"replicated"`` that fits,
    in that order: a Megatron-Core module (``GPTModel``, bare or in Megatron's ``DistributedDataParallel``
    or ``Float16Module``: its own ``sharded_state_dict()`` places its tensor- and pipeline-parallel
    slices), a DeepSpeed ZeRO-3 engine or partitioned module, then a model holding an FSDP1 unit,
    then one with a DTensor parameter (``fully_shard``, tensor or expert parallel); anything else
    (a plain module, DDP, DeepSpeed ZeRO-0/1/2) is replicated.

    Args:
        model: The model as the user holds it (wrapped or not).

    Returns:
        The strategy's name, one that ``WeightAverager(strategy=...)`` accepts.

    Examples:
        >>> import torch, shardavg
        >>> shardavg.detect(torch.nn.Linear(4, 2))
        'replicated'
    """
    return next(name for name, cls in STRATEGIES.items() if cls.fits(model))


SOURCES = ("live", "master")


def make_strategy(
    model: nn.Module | Sequence[nn.Module], strategy: str = "auto", source: str = "live", pipeline: Any = None
) -> Strategy:
    """Build the strategy that tells the averager which tensors ``model`` has and where this rank's part is.

    Args:
        model: The model; with ``pipeline``, this rank's stage or a list of its stages; a Megatron-Core
            model may be its list of virtual-pipeline chunks without ``pipeline`` (Megatron's own
            pipeline group is used).
        strategy: A strategy's name, or ``"auto"`` (default) for the one ``detect`` picks.
        source: ``"live"`` (default) averages the weights the model holds; ``"master"`` a DeepSpeed
            engine's fp32 masters (ZeRO-1, 2 or 3).
        pipeline: The pipeline's process group or mesh: the averager then covers every stage's
            tensors (``pipeline.py``). None (default): no pipeline.

    Returns:
        The strategy.

    Raises:
        StrategyError: An unknown ``strategy`` or ``source``, a strategy or ``"master"`` source that
            does not fit the model, a list of stages without ``pipeline`` or a stage that is no module; for the
            replicated and ZeRO-1/2 strategies, tensors that are not replicas (Megatron's tensor-parallel
            slices, or shapes that differ between ranks: ``replicated.refuse_non_replicas``).
    """
    if pipeline is not None:
        stages = list(model) if isinstance(model, (list, tuple)) else [model]
        if not stages or not all(isinstance(stage, nn.Module) for stage in stages):
            raise StrategyError(f"with pipeline=..., pass this rank's stage module or a list of them, got {model!r}")
        strategies = [_one(stage, strategy, source) for stage in stages]
        refuse_non_replicas(strategies, compare_shapes=False)  # (the stages compare their ranks' tensors themselves)
        return Pipeline(strategies, pipeline)
    if strategy in ("auto", Megatron.name) and source == "live" and is_megatron(model):
        return megatron_strategy(model)  # (its stages, if any, from Megatron's own pipeline group)
    if isinstance(model, (list, tuple)):
        raise StrategyError(
            "a list of modules is a pipeline's stages: pass pipeline=<the pipeline's process group or mesh>"
        )
    one = _one(model, strategy, source)
    refuse_non_replicas([one], compare_shapes=True)
    return one


def _one(model: nn.Module, strategy: str, source: str) -> ModuleStrategy:
    """The strategy for one model (or pipeline stage), unchecked against the other ranks."""
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
        if cls is Megatron:
            raise StrategyError(
                "source='master' for a Megatron-Core model would average its DistributedOptimizer's fp32 master "
                "shards (1/DP of the model per rank); that source is not built (Megatron's DistributedOptimizer "
                "needs CUDA, so it cannot be tested here): use source='live', which averages the slices the model holds"
            )
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
    "SAVED_STRATEGIES",
    "STRATEGIES",
    "Megatron",
    "ModuleStrategy",
    "Pipeline",
    "Strategy",
    "StrategyError",
    "TensorInfo",
    "canonical_name",
    "detect",
    "make_strategy",
    "refuse_unlike_values",
    "unwrap",
]
