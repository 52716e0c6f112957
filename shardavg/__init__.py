"""shardavg: shard-local weight averaging (EMA, SWA, power-function EMA) for distributed training.

This module, ``posthoc``, ``cli`` and ``__main__`` are the face: what users call, with the averager
(``averager/``, whose ``WeightAverager`` this module exports). The other packages are the folders and
``rules`` (docs/packages.md); this docstring says what the face stands on.

It may import: base, rules, strategies, update, checkpoints, output, averager, offline.
"""

from .averager import WeightAverager, update_bn
from .base.errors import (
    CheckpointError,
    ExportError,
    LayoutError,
    ModelChangedError,
    NonFiniteError,
    ProvenanceError,
    StrategyError,
)
from .checkpoints.ownership import TargetLock
from .offline.merge import merge
from .offline.saved_average import check_dcp
from .posthoc import PostHocEMA
from .rules import (
    EMA,
    SWA,
    AvgFnRule,
    CustomRule,
    HalfLifeFractionEMA,
    InverseGammaWarmup,
    PowerEMA,
    RatioWarmup,
    Rule,
    rule_from_config,
)
from .strategies import detect
from .update.options import Options

__version__ = "0.13.0"

__all__ = [
    "EMA",
    "SWA",
    "AvgFnRule",
    "CheckpointError",
    "CustomRule",
    "ExportError",
    "HalfLifeFractionEMA",
    "InverseGammaWarmup",
    "LayoutError",
    "ModelChangedError",
    "NonFiniteError",
    "Options",
    "PostHocEMA",
    "PowerEMA",
    "ProvenanceError",
    "RatioWarmup",
    "Rule",
    "StrategyError",
    "TargetLock",
    "WeightAverager",
    "check_dcp",
    "detect",
    "merge",
    "rule_from_config",
    "update_bn",
]
