"""shardavg: shard-local weight averaging (EMA, SWA, power-function EMA) for distributed training."""

from .averager import WeightAverager
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
    CustomRule,
    InverseGammaWarmup,
    PowerEMA,
    RatioWarmup,
    Rule,
    rule_from_config,
)
from .strategies import detect

__version__ = "0.11.0"

__all__ = [
    "EMA",
    "SWA",
    "CheckpointError",
    "CustomRule",
    "ExportError",
    "InverseGammaWarmup",
    "LayoutError",
    "ModelChangedError",
    "NonFiniteError",
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
]
