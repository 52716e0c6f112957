"""Averaging rules: how far the average moves toward the live weights at each update.

Every built-in rule is a *lerp rule*. After ``n`` earlier updates (``n >= 1``) the shadow
moves toward the live weights by ``weight(n)``::

    shadow <- shadow + weight(n) * (live - shadow)

and the first update (``n == 0``) copies the live weights, as
``torch.optim.swa_utils.AveragedModel`` does. A rule is plain data: ``to_config()`` gives a
dict that is saved with the averager's state, compared on load and written in YAML;
``rule_from_config`` builds the rule back. A description records it with ``to_json`` and reads it
back, checked, with ``Rule.from_json``.

Any callable with torch's ``multi_avg_fn(shadow_list, live_list, num_updates)`` signature is
accepted as well (see ``CustomRule``), e.g. ``torch.optim.swa_utils.get_ema_multi_avg_fn``.

It may import: base.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .base import validate
from .base.errors import CheckpointError

MultiAvgFn = Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor], None]

# The ranges where a rule's weights are right in float64 (measured; see tests/test_numbers.py):
MAX_HALF_LIFE = 1e16  # above ln(2) 2**54 = 1.25e16, 0.5 ** (1 / half_life) rounds to 1.0: the average never moves
MAX_GAMMA = 1e6  # PowerEMA: gamma ~ 1 / sigma_rel; EDM2's profiles use 3 to 100 or so
MIN_SIGMA_REL = 1e-6  # ~ gamma 1e6 (sigma_rel_to_gamma itself goes wrong near 1e-10 and overflows below 1e-100)
MAX_SIGMA_REL = 0.3003  # the widest profile (gamma -> -1)


def shown(value: Any) -> str:
    """A value as an error message shows it: one short line, whatever it is.

    Args:
        value: Anything.

    Returns:
        Its ``repr``, cut to 40 characters (ending in ``...`` when cut).
    """
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _number(rule: Any, name: str) -> float:
    """The field ``name`` of a frozen rule or warm-up, checked by ``_check_number`` and stored back
    as a plain float (so a numpy scalar or a Fraction computes and compares like one)."""
    number = _check_number(type(rule).__name__, name, getattr(rule, name))
    object.__setattr__(rule, name, number)
    return number


def _check_number(owner: str, name: str, value: Any) -> float:
    """``value`` as a finite float: any real number (numpy's included), never a bool, a string,
    NaN, an infinity, or an int too large for a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}: {name} must be a finite number, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{owner}: {name} must be a finite number, got {shown(value)}")
    return number


# --------------------------------------------------------------------------- warm-ups


class Warmup(ABC):
    """A ramp for the EMA decay over the first updates; the rule caps it at its own decay."""

    @abstractmethod
    def decay(self, num_updates: int) -> float:
        """The decay of the update that follows ``num_updates`` earlier ones, before the rule caps it.

        Args:
            num_updates: Updates applied before this one (``>= 1``).

        Returns:
            The uncapped decay, in [0, 1).
        """

    @abstractmethod
    def to_config(self) -> dict[str, Any]:
        """Plain-data description, saved inside the rule's (``warmup_from_config`` builds it back).

        Returns:
            A dict with the warm-up's ``kind`` and its fields.
        """


@dataclass(frozen=True)
class InverseGammaWarmup(Warmup):
    """``1 - (1 + t / inv_gamma) ** -power``: the ramp of timm's ModelEmaV3 and diffusers' EMAModel.

    Args:
        inv_gamma: Scale of the ramp in updates (> 0): larger ramps up more slowly. Default 1.0.
        power: Exponent (> 0): ``2/3`` (default) suits runs of up to about a million steps,
            ``3/4`` shorter ones.

    Raises:
        ValueError: ``inv_gamma`` or ``power`` is not a finite number > 0.
    """

    inv_gamma: float = 1.0
    power: float = 2.0 / 3.0

    def __post_init__(self) -> None:
        for name in ("inv_gamma", "power"):
            if _number(self, name) <= 0:
                raise ValueError(f"InverseGammaWarmup: {name} must be > 0, got {shown(getattr(self, name))}")

    def decay(self, num_updates: int) -> float:
        """The ramp's decay after ``num_updates`` updates (see ``Warmup.decay``).

        Args:
            num_updates: Updates applied before this one.

        Returns:
            ``1 - (1 + num_updates / inv_gamma) ** -power``.
        """
        return 1.0 - (1.0 + num_updates / self.inv_gamma) ** -self.power

    def to_config(self) -> dict[str, Any]:
        """Plain-data description.

        Returns:
            ``{"kind": "inverse_gamma", "inv_gamma": ..., "power": ...}``.
        """
        return {"kind": "inverse_gamma", "inv_gamma": float(self.inv_gamma), "power": float(self.power)}


@dataclass(frozen=True)
class RatioWarmup(Warmup):
    """``(1 + t) / (10 + t)``: the ramp of TensorFlow's ExponentialMovingAverage ``num_updates``."""

    def decay(self, num_updates: int) -> float:
        """The ramp's decay after ``num_updates`` updates (see ``Warmup.decay``).

        Args:
            num_updates: Updates applied before this one.

        Returns:
            ``(1 + num_updates) / (10 + num_updates)``.
        """
        return (1.0 + num_updates) / (10.0 + num_updates)

    def to_config(self) -> dict[str, Any]:
        """Plain-data description.

        Returns:
            ``{"kind": "ratio"}``.
        """
        return {"kind": "ratio"}


def warmup_from_config(config: Mapping[str, Any]) -> Warmup:
    """Build a warm-up from ``Warmup.to_config()`` output (or the same dict from YAML).

    Args:
        config: A mapping with ``kind`` ``"inverse_gamma"`` (and its fields) or ``"ratio"``.

    Returns:
        The warm-up.

    Raises:
        TypeError: ``config`` is not a mapping.
        ValueError: An unknown ``kind``, or a field missing or out of range.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"a warm-up config must be a mapping with a 'kind', got {config!r}")
    kind = config.get("kind")
    if kind == "inverse_gamma":  # a missing value is refused by the warm-up's own check
        return InverseGammaWarmup(inv_gamma=config.get("inv_gamma"), power=config.get("power"))
    if kind == "ratio":
        return RatioWarmup()
    raise ValueError(f"unknown warm-up kind {kind!r}; expected 'inverse_gamma' or 'ratio'")


# --------------------------------------------------------------------------- rules


class Rule(ABC):
    """Base of every rule the averager accepts: the built-in ones and ``CustomRule``.

    A rule is plain data; ``to_config`` describes it, and ``rule_from_config`` builds a built-in
    one back from that description.
    """

    @abstractmethod
    def to_config(self) -> dict[str, Any]:
        """Plain-data description, saved with the averager's state and compared on load.

        Returns:
            A dict with the rule's ``kind`` and its fields.
        """

    def to_json(self) -> dict[str, Any]:
        """The rule as a description records it: its ``to_config()``.

        Returns:
            A dict with the rule's ``kind`` and its fields.
        """
        return self.to_config()

    @staticmethod
    def from_json(data: Any, where: str) -> Rule | None:
        """The rule a description recorded (``to_json``), checked: a built-in rule's exact config,
        or a custom rule's, whose callable cannot be rebuilt from its name.

        Args:
            data: The recorded rule, as parsed JSON.
            where: Where it came from, for the message.

        Returns:
            The built-in rule, equal to the one that wrote ``data``; None for a custom rule.

        Raises:
            CheckpointError: ``data`` is not a rule's config (one line naming ``where``).
        """
        if isinstance(data, dict) and data.get("kind") == "custom":
            if set(data) != {"kind", "name"} or not isinstance(data["name"], str):
                raise CheckpointError(f"{where}: 'rule' is not a custom rule's config: {str(data)[:200]}")
            return None
        try:
            rule = rule_from_config(data) if isinstance(data, dict) else None
        except (ValueError, TypeError, KeyError) as error:
            raise CheckpointError(f"{where}: 'rule' {str(data)[:200]} is not a rule: {error!r}") from None
        if rule is None or rule.to_json() != data:
            raise CheckpointError(f"{where}: 'rule' {str(data)[:200]} is not a rule's config")
        return rule


class LerpRule(Rule):
    """A rule the averager applies itself with fused lerp kernels."""

    @abstractmethod
    def weight(self, num_updates: int) -> float:
        """Weight of the live weights in the update that follows ``num_updates`` earlier ones.

        Args:
            num_updates: Updates applied before this one (``>= 1``; the first update copies).

        Returns:
            The lerp weight, in (0, 1].
        """


@dataclass(frozen=True)
class EMA(LerpRule):
    """Exponential moving average: ``shadow <- decay * shadow + (1 - decay) * live``.

    Without a warm-up the result is bitwise that of ``AveragedModel`` with
    ``get_ema_multi_avg_fn(decay)``.

    Args:
        decay: The decay, in (0, 1). Give exactly one of ``decay`` and ``half_life``.
        half_life: The decay as a half-life in updates (after that many updates an old weight
            counts half), in (0, 1e16].
        warmup: ``InverseGammaWarmup(...)`` or ``RatioWarmup()`` to ramp the decay up from 0: the
            update after ``n`` earlier ones uses ``min(decay, warmup.decay(n))``. None (default):
            no warm-up.

    Raises:
        ValueError: Both or neither of ``decay`` and ``half_life``, or one out of its range.
        TypeError: ``warmup`` is not a warm-up.
    """

    decay: float | None = None
    half_life: float | None = None
    warmup: Warmup | None = None

    def __post_init__(self) -> None:
        if (self.decay is None) == (self.half_life is None):
            given = "both" if self.decay is not None else "neither"
            raise ValueError(f"EMA takes exactly one of decay= or half_life=, got {given}")
        if self.decay is not None:
            decay = _number(self, "decay")
            if not 0.0 < decay < 1.0:
                raise ValueError(f"EMA decay must be in the open interval (0, 1), got {shown(self.decay)}")
        else:
            half_life = _number(self, "half_life")
            if not 0 < half_life <= MAX_HALF_LIFE:
                raise ValueError(
                    f"EMA half_life must be > 0 updates and at most {MAX_HALF_LIFE:g} (beyond, the decay rounds "
                    f"to 1.0 and the average never moves), got {shown(self.half_life)}"
                )
        if self.warmup is not None and not isinstance(self.warmup, Warmup):
            raise TypeError(f"EMA warmup must be InverseGammaWarmup(...), RatioWarmup() or None, got {self.warmup!r}")

    @property
    def target_decay(self) -> float:
        """The decay reached after the warm-up: ``decay``, or ``0.5 ** (1 / half_life)``."""
        if self.decay is not None:
            return float(self.decay)
        return 0.5 ** (1.0 / float(self.half_life))  # type: ignore[arg-type]

    def weight(self, num_updates: int) -> float:
        """Weight of the live weights in the update that follows ``num_updates`` earlier ones.

        Args:
            num_updates: Updates applied before this one.

        Returns:
            ``1 - decay``, the decay capped by the warm-up's, if any.
        """
        decay = self.target_decay
        if self.warmup is not None:
            decay = min(decay, self.warmup.decay(num_updates))
        return 1.0 - decay

    def to_config(self) -> dict[str, Any]:
        """Plain-data description.

        Returns:
            ``{"kind": "ema", "decay" or "half_life": ..., "warmup": its config or None}``.
        """
        config: dict[str, Any] = {"kind": "ema"}
        if self.decay is not None:
            config["decay"] = float(self.decay)
        else:
            config["half_life"] = float(self.half_life)  # type: ignore[arg-type]
        config["warmup"] = None if self.warmup is None else self.warmup.to_config()
        return config


@dataclass(frozen=True)
class SWA(LerpRule):
    """Stochastic weight averaging: the equal-weight running mean of every update."""

    def weight(self, num_updates: int) -> float:
        """Weight of the live weights in the update that follows ``num_updates`` earlier ones.

        Args:
            num_updates: Updates applied before this one.

        Returns:
            ``1 / (num_updates + 1)``.
        """
        return 1.0 / (num_updates + 1)

    def to_config(self) -> dict[str, Any]:
        """Plain-data description.

        Returns:
            ``{"kind": "swa"}``.
        """
        return {"kind": "swa"}


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """EDM2's conversion from relative standard deviation to the power-function exponent.

    Solves ``g**3 + 7 g**2 + (16 - s**-2) g + (12 - s**-2) = 0`` for its largest real root by
    Newton's method started to the right of every root (the cubic is convex and increasing
    there, so the iteration decreases monotonically onto that root).

    Args:
        sigma_rel: The profile's relative standard deviation (``PowerEMA`` accepts [1e-6, 0.3003)).

    Returns:
        The exponent ``gamma``.
    """
    inv2 = sigma_rel**-2
    gamma = max(1.0, inv2)
    for _ in range(200):
        f = ((gamma + 7.0) * gamma + (16.0 - inv2)) * gamma + (12.0 - inv2)
        df = (3.0 * gamma + 14.0) * gamma + (16.0 - inv2)
        step = f / df
        gamma -= step
        if abs(step) <= 1e-12 * max(1.0, abs(gamma)):
            break
    return gamma


def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative standard deviation of the power-function EMA profile with exponent ``gamma``.

    Args:
        gamma: The exponent, > -1.

    Returns:
        ``sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))``.
    """
    return math.sqrt((gamma + 1.0) / ((gamma + 2.0) ** 2 * (gamma + 3.0)))


@dataclass(frozen=True)
class PowerEMA(LerpRule):
    """EDM2's power-function EMA: ``beta_t = (1 - 1/t) ** (gamma + 1)`` at the ``t``-th update.

    The update after ``n`` earlier ones is update ``t = n + 1``, so its weight is ``1 - beta_t``;
    ``gamma = 0`` is SWA.

    Args:
        gamma: The exponent, in (-1, 1e6]; EDM2 uses about 3 to 17. Give exactly one of ``gamma``
            and ``sigma_rel``.
        sigma_rel: The relative width of the averaging profile, in [1e-6, 0.3003); EDM2 uses 0.05
            to 0.15.

    Raises:
        ValueError: Both or neither of ``gamma`` and ``sigma_rel``, or one out of its range.
    """

    gamma: float | None = None
    sigma_rel: float | None = None

    def __post_init__(self) -> None:
        if (self.gamma is None) == (self.sigma_rel is None):
            given = "both" if self.gamma is not None else "neither"
            raise ValueError(f"PowerEMA takes exactly one of gamma= or sigma_rel=, got {given}")
        if self.gamma is not None:
            if not -1.0 < _number(self, "gamma") <= MAX_GAMMA:
                raise ValueError(f"PowerEMA gamma must be > -1 and at most {MAX_GAMMA:g}, got {shown(self.gamma)}")
        else:
            sigma_rel = _number(self, "sigma_rel")
            gamma = sigma_rel_to_gamma(sigma_rel) if MIN_SIGMA_REL <= sigma_rel < MAX_SIGMA_REL else math.nan
            if not (gamma > -1.0 and math.isclose(gamma_to_sigma_rel(gamma), sigma_rel, rel_tol=1e-9)):
                raise ValueError(
                    f"PowerEMA sigma_rel must be in [{MIN_SIGMA_REL:g}, {MAX_SIGMA_REL}) (from a profile a millionth "
                    f"of the run wide to the widest power-function profile), got {shown(self.sigma_rel)}"
                )

    @property
    def exponent(self) -> float:
        """The exponent ``gamma``, given or derived from ``sigma_rel``."""
        if self.gamma is not None:
            return float(self.gamma)
        return sigma_rel_to_gamma(float(self.sigma_rel))  # type: ignore[arg-type]

    def weight(self, num_updates: int) -> float:
        """Weight of the live weights in the update that follows ``num_updates`` earlier ones.

        Args:
            num_updates: Updates applied before this one.

        Returns:
            ``1 - (1 - 1/t) ** (gamma + 1)`` with ``t = num_updates + 1``.
        """
        t = num_updates + 1
        return 1.0 - (1.0 - 1.0 / t) ** (self.exponent + 1.0)

    def to_config(self) -> dict[str, Any]:
        """Plain-data description.

        Returns:
            ``{"kind": "power_ema", "gamma": ...}`` or ``{"kind": "power_ema", "sigma_rel": ...}``,
                as it was given.
        """
        if self.gamma is not None:
            return {"kind": "power_ema", "gamma": float(self.gamma)}
        return {"kind": "power_ema", "sigma_rel": float(self.sigma_rel)}  # type: ignore[arg-type]


class CustomRule(Rule):
    """Wraps a ``multi_avg_fn(shadow_list, live_list, num_updates)`` callable.

    The averager calls it once per (device, dtype) group with lists of shadow shards and
    local shards of the same dtype (local shards are cast in bounded buckets when the shadow
    dtype differs) and ``num_updates`` as a 0-d integer tensor on the group's device,
    exactly as ``AveragedModel`` does. Passing the callable itself as a rule wraps it so.

    Args:
        fn: The callable, e.g. ``torch.optim.swa_utils.get_ema_multi_avg_fn(0.999)``; it updates
            the shadows in place.

    Raises:
        TypeError: ``fn`` is not callable.
    """

    def __init__(self, fn: MultiAvgFn) -> None:
        if not callable(fn):
            raise TypeError(f"a custom rule must be callable, got {fn!r}")
        self.fn = fn

    def __repr__(self) -> str:
        return f"CustomRule({self.name})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CustomRule) and other.fn is self.fn

    def __hash__(self) -> int:
        return hash(self.fn)

    @property
    def name(self) -> str:
        """The callable's ``module.qualname``: what the saved config records and load compares."""
        fn = self.fn
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"

    def to_config(self) -> dict[str, Any]:
        """Plain-data description (a custom rule cannot be rebuilt from it).

        Returns:
            ``{"kind": "custom", "name": name}``.
        """
        return {"kind": "custom", "name": self.name}


def as_rule(rule: Rule | MultiAvgFn) -> Rule:
    """A rule from what ``WeightAverager`` accepts: a rule, or a ``multi_avg_fn`` callable.

    Args:
        rule: A ``Rule``, or a callable to wrap in ``CustomRule``.

    Returns:
        The rule.

    Raises:
        TypeError: ``rule`` is a warm-up, or neither a rule nor callable.
    """
    if isinstance(rule, Rule):
        return rule
    if isinstance(rule, Warmup):
        raise TypeError(f"{rule!r} is a warm-up, not a rule: pass EMA(decay=..., warmup={rule!r})")
    if callable(rule):
        return CustomRule(rule)
    raise TypeError(f"rule must be EMA(...), SWA(), PowerEMA(...) or a multi_avg_fn callable, got {rule!r}")


def named_rules(rule: Rule | MultiAvgFn | Mapping[str, Rule | MultiAvgFn]) -> dict[str | None, Rule]:
    """An averager's averages by name: ``{None: rule}`` for one rule; a dict's, each name checked.

    Args:
        rule: One rule or callable, or a mapping from average names to them.

    Returns:
        Each average's rule by name (``None`` for a single, unnamed one).

    Raises:
        ValueError: An empty mapping, or a name that is not a plain word.
        TypeError: A value that is neither a rule nor callable.
    """
    if not isinstance(rule, Mapping):
        return {None: as_rule(rule)}
    if not rule:
        raise ValueError("rule={} names no average: give at least one, e.g. {'ema': EMA(decay=0.999)}")
    validate.average_names(list(rule))
    return {name: as_rule(value) for name, value in rule.items()}


def rule_from_config(config: Mapping[str, Any]) -> Rule:
    """Build a built-in rule from ``Rule.to_config()`` output (or the same dict from YAML).

    Args:
        config: A mapping with ``kind`` ``"ema"``, ``"swa"`` or ``"power_ema"`` and the rule's
            fields (a missing field is None).

    Returns:
        The rule, equal to the one that wrote ``config``.

    Raises:
        TypeError: ``config`` is not a mapping.
        ValueError: An unknown ``kind``, a custom rule's config (pass the callable itself), or
            fields the rule refuses.

    Examples:
        >>> from shardavg import EMA, rule_from_config
        >>> rule_from_config(EMA(half_life=100).to_config()) == EMA(half_life=100)
        True
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"a rule config must be a mapping with a 'kind', got {config!r}")
    kind = config.get("kind")
    if kind == "ema":
        warmup = config.get("warmup")
        return EMA(
            decay=config.get("decay"),
            half_life=config.get("half_life"),
            warmup=None if warmup is None else warmup_from_config(warmup),
        )
    if kind == "swa":
        return SWA()
    if kind == "power_ema":
        return PowerEMA(gamma=config.get("gamma"), sigma_rel=config.get("sigma_rel"))
    if kind == "custom":
        raise ValueError(
            f"rule {config.get('name')!r} is a custom callable: it cannot be rebuilt from its "
            "config; pass the callable itself"
        )
    raise ValueError(f"unknown rule kind {kind!r}; expected 'ema', 'swa' or 'power_ema'")
