"""Averaging rules: how far the average moves toward the live weights at each update.

Every built-in rule is a *lerp rule*. After ``n`` earlier updates (``n >= 1``) the shadow
moves toward the live weights by ``weight(n)``::

    shadow <- shadow + weight(n) * (live - shadow)

and the first update (``n == 0``) copies the live weights, as
``torch.optim.swa_utils.AveragedModel`` does. A rule is plain data: ``to_config()`` gives a
dict that is saved with the averager's state, compared on load and written in YAML;
``rule_from_config`` builds the rule back. A description records it with ``to_json`` and reads it
back, checked, with ``Rule.from_json``.

Torch's two kinds of averaging function are taken too, as ``AveragedModel`` takes them: a
``multi_avg_fn(shadow_list, live_list, num_updates)`` as the rule (``CustomRule``), e.g.
``torch.optim.swa_utils.get_ema_multi_avg_fn``, and a per-tensor ``avg_fn(averaged, current,
num_averaged)`` through ``WeightAverager(avg_fn=...)`` (``AvgFnRule``), e.g. ``get_ema_avg_fn``.
Both take three arguments, so a callable passed as the rule is a ``multi_avg_fn``; torch's own
per-tensor functions are recognised by name there and refused with the fix (see ``CustomRule``).

It may import: base.
"""

from __future__ import annotations

import inspect
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
AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# torch.optim.swa_utils' factories, by the kind of function they make: their functions carry the
# factory's name in their qualname ("get_ema_avg_fn.<locals>.ema_update"), which is how a per-tensor
# one passed as the rule (or a per-list one passed as avg_fn=) is told apart from the other kind.
PER_TENSOR_FACTORIES = {"get_ema_avg_fn": "get_ema_multi_avg_fn", "get_swa_avg_fn": "get_swa_multi_avg_fn"}
PER_LIST_FACTORIES = {multi: single for single, multi in PER_TENSOR_FACTORIES.items()}

# The ranges where a rule's weights are right in float64 (measured; see tests/test_numbers.py):
MAX_HALF_LIFE = 1e16  # above ln(2) 2**54 = 1.25e16, 0.5 ** (1 / half_life) rounds to 1.0: the average never moves
MAX_GAMMA = 1e6  # PowerEMA: gamma ~ 1 / sigma_rel; EDM2's profiles use 3 to 100 or so
MIN_SIGMA_REL = 1e-6  # ~ gamma 1e6 (sigma_rel_to_gamma itself goes wrong near 1e-10 and overflows below 1e-100)
MAX_SIGMA_REL = 0.3003  # the widest profile (gamma -> -1)
# HalfLifeFractionEMA: with step_bias at most this and half_life_fraction at most 1, the half-life
# (half_life_fraction * t updates) stays below MAX_HALF_LIFE in any run of fewer than 1e16 updates.
MAX_STEP_BIAS = 10**15


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
    """A ramp for the EMA decay over the first updates; the rule caps it at its own decay.

    Every warm-up also takes ``min_decay``, a floor under the ramp (timm's and diffusers'
    ``min_decay``, ema-pytorch's ``min_value``): the update after ``n >= 1`` earlier ones uses
    ``max(min(decay, ramp(n)), min_decay)``. The first update still copies, as in those peers
    (their decay is 0 at the first update, whatever the floor).
    """

    min_decay: float

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

    def _check_min_decay(self) -> None:
        """Refuse a ``min_decay`` outside [0, 1) in one line; store it as a plain float."""
        if not 0.0 <= _number(self, "min_decay") < 1.0:
            raise ValueError(f"{type(self).__name__}: min_decay must be in [0, 1), got {shown(self.min_decay)}")

    def _with_min_decay(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with ``min_decay`` when there is a floor: without one the config is what it was
        before warm-ups had floors, so checkpoints saved then still compare equal on load."""
        return (config | {"min_decay": float(self.min_decay)}) if self.min_decay else config


@dataclass(frozen=True)
class InverseGammaWarmup(Warmup):
    """``1 - (1 + t / inv_gamma) ** -power``: the ramp of timm's ModelEmaV3 and diffusers' EMAModel.

    Args:
        inv_gamma: Scale of the ramp in updates (> 0): larger ramps up more slowly. Default 1.0.
        power: Exponent (> 0): ``2/3`` (default) suits runs of up to about a million steps,
            ``3/4`` shorter ones.
        min_decay: The floor of the decay, in [0, 1) (timm's ``min_decay``, ema-pytorch's
            ``min_value``); the rule refuses one above its own decay. Default 0.0: no floor.

    Raises:
        ValueError: ``inv_gamma`` or ``power`` is not a finite number > 0, or ``min_decay`` is
            outside [0, 1).
    """

    inv_gamma: float = 1.0
    power: float = 2.0 / 3.0
    min_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("inv_gamma", "power"):
            if _number(self, name) <= 0:
                raise ValueError(f"InverseGammaWarmup: {name} must be > 0, got {shown(getattr(self, name))}")
        self._check_min_decay()

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
            ``{"kind": "inverse_gamma", "inv_gamma": ..., "power": ...}``, and ``"min_decay"`` when
                it is not 0.
        """
        return self._with_min_decay(
            {"kind": "inverse_gamma", "inv_gamma": float(self.inv_gamma), "power": float(self.power)}
        )


@dataclass(frozen=True)
class RatioWarmup(Warmup):
    """``(1 + t) / (10 + t)``: the ramp of TensorFlow's ExponentialMovingAverage ``num_updates``.

    Args:
        min_decay: The floor of the decay, in [0, 1); the rule refuses one above its own decay.
            Default 0.0: no floor.

    Raises:
        ValueError: ``min_decay`` is outside [0, 1).
    """

    min_decay: float = 0.0

    def __post_init__(self) -> None:
        self._check_min_decay()

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
            ``{"kind": "ratio"}``, and ``"min_decay"`` when it is not 0.
        """
        return self._with_min_decay({"kind": "ratio"})


def warmup_from_config(config: Mapping[str, Any]) -> Warmup:
    """Build a warm-up from ``Warmup.to_config()`` output (or the same dict from YAML).

    Args:
        config: A mapping with ``kind`` ``"inverse_gamma"`` (and its fields) or ``"ratio"``, and
            optionally ``min_decay`` (0.0 when missing).

    Returns:
        The warm-up.

    Raises:
        TypeError: ``config`` is not a mapping.
        ValueError: An unknown ``kind``, or a field missing or out of range.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"a warm-up config must be a mapping with a 'kind', got {config!r}")
    kind = config.get("kind")
    min_decay = config.get("min_decay", 0.0)
    if kind == "inverse_gamma":  # a missing value is refused by the warm-up's own check
        return InverseGammaWarmup(inv_gamma=config.get("inv_gamma"), power=config.get("power"), min_decay=min_decay)
    if kind == "ratio":
        return RatioWarmup(min_decay=min_decay)
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
            update after ``n`` earlier ones uses ``max(min(decay, warmup.decay(n)), warmup.min_decay)``.
            None (default): no warm-up.

    Raises:
        ValueError: Both or neither of ``decay`` and ``half_life``, one out of its range, or a
            warm-up whose ``min_decay`` is above the decay (the floor would replace the decay).
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
        if self.warmup is not None and self.warmup.min_decay > self.target_decay:
            raise ValueError(
                f"EMA: the warm-up's min_decay {self.warmup.min_decay!r} is above the decay {self.target_decay!r}: "
                "give a floor at most the decay"
            )

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
            ``1 - decay``, the decay capped by the warm-up's and floored at its ``min_decay``, if any.
        """
        decay = self.target_decay
        if self.warmup is not None:
            decay = max(min(decay, self.warmup.decay(num_updates)), self.warmup.min_decay)
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


@dataclass(frozen=True)
class HalfLifeFractionEMA(LerpRule):
    """An EMA whose half-life is a fixed fraction of the updates so far: torchtitan's EMA schedule.

    The update after ``n`` earlier ones is update ``t = n + 1 + step_bias``, and its decay is
    ``2 ** (-1 / (half_life_fraction * t))``: an old weight counts half after
    ``half_life_fraction * t`` updates, so the average keeps about the last ``half_life_fraction``
    of the run however long it grows, where a fixed decay keeps a fixed number of updates.

    The formula is torchtitan's (``EMAOptimizersContainer._decay_at`` in
    ``torchtitan/components/ema.py``, pytorch/torchtitan's main branch: ``decay = 2 ** (-1 /
    (half_life_fraction * num_updates))``, its default 0.05 being the ``2 ** (-20 / t)`` rule of
    thumb). The bookkeeping differs: torchtitan lerps from a copy of the weights made when it is
    built, its first update with decay ``2 ** (-1 / half_life_fraction)`` (``2 ** -20`` at 0.05:
    nearly a copy); here the first update copies, as for every rule, and from the second on the
    decay is torchtitan's at the same update number. torchtitan counts ``step_bias`` in optimizer
    steps before dividing by its ``update_every_n_steps``; here it counts updates (the same with one
    update a step).

    Args:
        half_life_fraction: The half-life as a fraction of the updates so far, in (0, 1].
            Default 0.05, torchtitan's.
        step_bias: Updates the schedule counts before the first, as if the average were already
            that old (torchtitan's ``step_bias``): an int in [0, 1e15], default 0. A resume needs
            none (the count is the average's own ``num_updates``, saved and restored with it,
            whatever the loop numbers its steps), and ``restart(step)`` starts the count over.

    Raises:
        ValueError: ``half_life_fraction`` outside (0, 1], or ``step_bias`` not an int in range.
    """

    half_life_fraction: float = 0.05
    step_bias: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < _number(self, "half_life_fraction") <= 1.0:
            raise ValueError(
                "HalfLifeFractionEMA: half_life_fraction must be in (0, 1] (a fraction of the updates so far), "
                f"got {shown(self.half_life_fraction)}"
            )
        bias = self.step_bias
        if isinstance(bias, bool) or not isinstance(bias, numbers.Integral) or not 0 <= bias <= MAX_STEP_BIAS:
            raise ValueError(
                f"HalfLifeFractionEMA: step_bias must be an int in [0, {MAX_STEP_BIAS:.0e}] (updates counted before "
                f"the first), got {shown(bias)}"
            )
        object.__setattr__(self, "step_bias", int(bias))

    def weight(self, num_updates: int) -> float:
        """Weight of the live weights in the update that follows ``num_updates`` earlier ones.

        Args:
            num_updates: Updates applied before this one.

        Returns:
            ``1 - 2 ** (-1 / (half_life_fraction * t))`` with ``t = num_updates + 1 + step_bias``.
        """
        t = num_updates + 1 + self.step_bias
        return 1.0 - 2.0 ** (-1.0 / (self.half_life_fraction * t))

    def to_config(self) -> dict[str, Any]:
        """Plain-data description.

        Returns:
            ``{"kind": "half_life_fraction", "half_life_fraction": ..., "step_bias": ...}``.
        """
        return {
            "kind": "half_life_fraction",
            "half_life_fraction": float(self.half_life_fraction),
            "step_bias": self.step_bias,
        }


def callable_name(fn: Callable[..., Any]) -> str:
    """A callable's ``module.qualname``: what a custom rule's config records and load compares.

    Args:
        fn: Any callable.

    Returns:
        ``module.qualname`` (``?`` for a missing module, the type's name for a missing qualname).
    """
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _torch_factory(fn: Callable[..., Any]) -> str | None:
    """The ``torch.optim.swa_utils`` factory that made ``fn`` (``"get_ema_avg_fn"``, ...), read from its
    qualname (``get_ema_avg_fn.<locals>.ema_update``; torch.no_grad's wrapper keeps it), or None."""
    if getattr(fn, "__module__", None) != "torch.optim.swa_utils":
        return None
    factory = getattr(fn, "__qualname__", "").split(".")[0]
    return factory if factory in PER_TENSOR_FACTORIES or factory in PER_LIST_FACTORIES else None


def _declared_kind(fn: Callable[..., Any]) -> str | None:
    """``"avg_fn"`` or ``"multi_avg_fn"`` where ``fn`` says which of torch's two averaging signatures it
    has; None where it does not say.

    Both take three arguments, so the arguments cannot tell them apart. torch's own functions say it
    by name (one from ``get_ema_avg_fn`` has ``get_ema_avg_fn.<locals>`` in its qualname); any function
    by its return annotation: an ``avg_fn`` returns the new average (``-> Tensor``), a
    ``multi_avg_fn`` updates in place (``-> None``). An unannotated function of one's own says nothing.
    """
    factory = _torch_factory(fn)
    if factory is not None:
        return "avg_fn" if factory in PER_TENSOR_FACTORIES else "multi_avg_fn"
    try:
        returns = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):  # (a callable without a signature: some builtins)
        return None
    if returns is torch.Tensor or returns in ("Tensor", "torch.Tensor"):
        return "avg_fn"
    if returns is None or returns == "None":
        return "multi_avg_fn"
    return None


class CustomRule(Rule):
    """Wraps a ``multi_avg_fn(shadow_list, live_list, num_updates)`` callable.

    The averager calls it once per (device, dtype) group with lists of shadow shards and
    local shards of the same dtype (local shards are cast in bounded buckets when the shadow
    dtype differs) and ``num_updates`` as a 0-d integer tensor on the group's device,
    exactly as ``AveragedModel`` does. Passing the callable itself as a rule wraps it so.

    A per-tensor ``avg_fn`` has the same three arguments, so a callable given as the rule is
    taken for a ``multi_avg_fn`` unless it says otherwise: one of torch's per-tensor functions
    (``get_ema_avg_fn``, ``get_swa_avg_fn``, known by name) or one annotated ``-> Tensor`` is
    refused here, naming ``avg_fn=`` (``AvgFnRule``), rather than failing inside it at the
    second update.

    Args:
        fn: The callable, e.g. ``torch.optim.swa_utils.get_ema_multi_avg_fn(0.999)``; it updates
            the shadows in place.

    Raises:
        TypeError: ``fn`` is not callable, or is a per-tensor ``avg_fn``.
    """

    def __init__(self, fn: MultiAvgFn) -> None:
        if not callable(fn):
            raise TypeError(f"a custom rule must be callable, got {fn!r}")
        if _declared_kind(fn) == "avg_fn":
            factory = _torch_factory(fn)
            torch_fix = "" if factory is None else f", or {PER_TENSOR_FACTORIES[factory]}(...) as the rule"
            raise TypeError(
                f"rule={callable_name(fn)} is a per-tensor avg_fn(averaged, current, num_averaged), not a "
                f"multi_avg_fn: pass it as avg_fn= (AvgFnRule(fn) in a dict of rules){torch_fix}"
            )
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
        return callable_name(self.fn)

    def to_config(self) -> dict[str, Any]:
        """Plain-data description (a custom rule cannot be rebuilt from it).

        Returns:
            ``{"kind": "custom", "name": name}``.
        """
        return {"kind": "custom", "name": self.name}


class AvgFnRule(Rule):
    """Wraps a per-tensor ``avg_fn(averaged, current, num_averaged)``: torch's other signature.

    ``WeightAverager(model, avg_fn=fn)`` builds one; ``AvgFnRule(fn)`` puts one in a dict of
    rules. ``fn`` is applied as ``AveragedModel(model, avg_fn=fn)`` applies it: the first update
    copies the live weights, and each later one sets, tensor by tensor,
    ``averaged.copy_(fn(averaged, current, num_averaged))``, with ``num_averaged`` the updates so
    far as a 0-d int64 tensor on the shadow's device.

    Each tensor here is this rank's part: ``averaged`` the shadow of a local shard, ``current``
    the local shard (cast to the shadow's dtype). So ``fn`` must be elementwise, each element of
    its result computed from the same element of its arguments, as torch's ``get_ema_avg_fn`` and
    ``get_swa_avg_fn`` are: an elementwise function gives an element the same bits in whatever
    slice of the tensor it is computed, so the average is bitwise what ``AveragedModel`` computes
    on the full tensors (fp32, on any number of ranks). A function that looks across elements (a
    norm, a mean, the shape) would see only this rank's shard.

    Args:
        avg_fn: The function, e.g. ``torch.optim.swa_utils.get_ema_avg_fn(0.999)``: it returns the
            new average and leaves its arguments alone.

    Raises:
        TypeError: ``avg_fn`` is not callable, or is a ``multi_avg_fn`` (torch's
            ``get_*_multi_avg_fn``, or one annotated ``-> None``): pass that as the rule.
    """

    def __init__(self, avg_fn: AvgFn) -> None:
        if not callable(avg_fn):
            raise TypeError(f"avg_fn= must be a callable avg_fn(averaged, current, num_averaged), got {shown(avg_fn)}")
        if _declared_kind(avg_fn) == "multi_avg_fn":
            raise TypeError(
                f"avg_fn={callable_name(avg_fn)} is a multi_avg_fn (it updates lists of tensors in place), not a "
                "per-tensor avg_fn: pass it as rule="
            )
        self.avg_fn = avg_fn

    def __repr__(self) -> str:
        return f"AvgFnRule({callable_name(self.avg_fn)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AvgFnRule) and other.avg_fn is self.avg_fn

    def __hash__(self) -> int:
        return hash(self.avg_fn)

    @property
    def name(self) -> str:
        """The function's ``module.qualname`` marked ``(avg_fn)``: what the saved config records."""
        return f"{callable_name(self.avg_fn)} (avg_fn)"

    def fn(self, averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        """The update, called as a ``CustomRule``'s function is (per group, with lists): ``avg_fn``
        applied to each pair of tensors and its result copied into the shadow, as ``AveragedModel``
        does.

        Args:
            averaged: The shadows.
            current: The local shards, in the shadows' dtype and on their device.
            num_averaged: The updates so far, a 0-d int64 tensor on the shadows' device.

        Raises:
            TypeError: ``avg_fn`` returned something other than a tensor.
        """
        for shadow, live in zip(averaged, current, strict=True):
            result = self.avg_fn(shadow, live, num_averaged)
            if not isinstance(result, torch.Tensor):
                raise TypeError(
                    f"avg_fn={callable_name(self.avg_fn)} returned {shown(result)}, not a tensor: an avg_fn returns "
                    "the new average (one that updates in place is a multi_avg_fn: pass it as rule=)"
                )
            shadow.copy_(result)

    def to_config(self) -> dict[str, Any]:
        """Plain-data description (it cannot be rebuilt from it): recorded as a custom rule's.

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
        TypeError: ``rule`` is a warm-up, a per-tensor ``avg_fn``, or neither a rule nor callable.
    """
    if isinstance(rule, Rule):
        return rule
    if isinstance(rule, Warmup):
        raise TypeError(f"{rule!r} is a warm-up, not a rule: pass EMA(decay=..., warmup={rule!r})")
    if callable(rule):
        return CustomRule(rule)
    raise TypeError(
        "rule must be EMA(...), SWA(), PowerEMA(...), HalfLifeFractionEMA(...) or a multi_avg_fn callable, "
        f"got {rule!r}"
    )


def named_rules(
    rule: Rule | MultiAvgFn | Mapping[str, Rule | MultiAvgFn] | None, avg_fn: AvgFn | None = None
) -> dict[str | None, Rule]:
    """An averager's averages by name: ``{None: rule}`` for one rule or ``avg_fn``; a dict's, each
    name checked.

    Args:
        rule: One rule or callable, or a mapping from average names to them; None with ``avg_fn``.
        avg_fn: A per-tensor ``avg_fn`` (``AvgFnRule``) in place of ``rule``, or None.

    Returns:
        Each average's rule by name (``None`` for a single, unnamed one).

    Raises:
        ValueError: An empty mapping, or a name that is not a plain word.
        TypeError: Both or neither of ``rule`` and ``avg_fn``, or a value that is neither a rule
            nor callable (or a callable of the other kind).
    """
    if (rule is None) == (avg_fn is None):
        given = "both" if avg_fn is not None else "neither"
        raise TypeError(
            f"give one of rule= and avg_fn=, got {given} (to keep an avg_fn beside other averages: "
            "rule={'name': AvgFnRule(fn), ...})"
        )
    if avg_fn is not None:
        return {None: AvgFnRule(avg_fn)}
    if not isinstance(rule, Mapping):
        return {None: as_rule(rule)}
    if not rule:
        raise ValueError("rule={} names no average: give at least one, e.g. {'ema': EMA(decay=0.999)}")
    validate.average_names(list(rule))
    return {name: as_rule(value) for name, value in rule.items()}


def rule_from_config(config: Mapping[str, Any]) -> Rule:
    """Build a built-in rule from ``Rule.to_config()`` output (or the same dict from YAML).

    Args:
        config: A mapping with ``kind`` ``"ema"``, ``"swa"``, ``"power_ema"`` or
            ``"half_life_fraction"`` and the rule's fields (a missing field is None).

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
    if kind == "half_life_fraction":
        return HalfLifeFractionEMA(
            half_life_fraction=config.get("half_life_fraction"), step_bias=config.get("step_bias")
        )
    if kind == "custom":
        raise ValueError(
            f"rule {config.get('name')!r} is a custom callable: it cannot be rebuilt from its "
            "config; pass the callable itself"
        )
    raise ValueError(f"unknown rule kind {kind!r}; expected 'ema', 'swa', 'power_ema' or 'half_life_fraction'")
