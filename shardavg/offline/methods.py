"""The merge's methods: how much of each input a merge takes, apart from how it reads and writes.

A method is a small frozen dataclass whose fields are its parameters, declared there once, with
``shares``: one share per input, in input order, from the inputs' steps where it needs them
(``needs_steps``). Each is registered by name (``@register``), and ``method(name, **parameters)``
finds one, its error listing every name there is, as Lightning Fabric's strategy registry does.
A method says how it is given (``keyword``: its ``shardavg.merge`` keyword and ``--`` option,
``parameter``: the field that value fills, ``option``: the rest of its command-line option), so
the merge and the command line take every registered method without naming any: adding one is a
class here.

The methods:

- ``uniform``: every input alike; the average of the last K checkpoints of a run (LAWA: Kaddour,
  "Stop Wasting My Time! Saving Days of ImageNet and BERT Training with Latest Weight Averaging",
  arXiv:2209.14981) or of fine-tuned models (a model soup: Wortsman et al., arXiv:2203.05482).
- ``weights``: the weights given, normalised to sum to 1, or taken as given (``normalize=False``:
  task arithmetic, Ilharco et al., "Editing Models with Task Arithmetic", arXiv:2212.04089).
- ``ema``: an EMA of decay ``d`` per step over the saved steps: the step ``s`` weighted by
  ``d ** (newest - s)``, normalised.
- ``wsm``: the weights that make the average of checkpoints saved under a constant learning rate
  the model a decay of the learning rate over their window would give (Warmup-Stable and Merge:
  Tian et al., "WSM: Decay-Free Learning Rate Schedule via Checkpoint Merging for LLM
  Pre-training", arXiv:2507.17634), for the decay shapes of ``DECAYS``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch

from ..base.dtypes import dtype_name
from ..base.errors import CheckpointError

Schedule = Literal["linear", "cosine", "minus-sqrt"]
DECAYS: dict[str, Callable[[float], float]] = {  # the learning rate's multiplier at progress x of the window
    "linear": lambda x: 1.0 - x,  # linear decay to zero: evenly spaced checkpoints weigh alike
    # cosine decay (Loshchilov and Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", arXiv:1608.03983)
    "cosine": lambda x: 0.5 * (1.0 + math.cos(math.pi * x)),
    # 1 - sqrt (Hägele et al., "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations",
    # arXiv:2405.18392)
    "minus-sqrt": lambda x: 1.0 - math.sqrt(x),
}


class Method:
    """One way of weighting a merge's inputs (subclassed by each method, a frozen dataclass)."""

    name: ClassVar[str]  # its name in the registry
    keyword: ClassVar[str | None] = None  # its shardavg.merge keyword and option (--KEYWORD); None: the default
    parameter: ClassVar[str] = ""  # the field the keyword's value fills
    option: ClassVar[dict[str, Any]] = {}  # argparse's keywords for its option besides the name (help, type, ...)
    needs_steps: ClassVar[bool] = False  # its shares come from the inputs' steps
    schedule: ClassVar[str | None] = None  # the learning-rate decay it stands in for, as provenance records it

    def shares(self, steps: Sequence[int], accumulate: torch.dtype) -> list[float]:
        """Each input's share, in input order: summing to 1, unless the method takes weights as given
        (then within what ``accumulate``, the dtype the merge sums in, holds). ``steps`` are the inputs'
        (each one's, distinct, where ``needs_steps``; else possibly None)."""
        raise NotImplementedError

    def as_given(self) -> Method:
        """This method taking its weights as given, not normalised (``normalize=False``): only one
        that is given weights can."""
        raise ValueError("normalize=False takes the weights as given: pass weights (--weights)")


METHODS: dict[str, type[Method]] = {}  # the registry: {name: method}, in the order registered


def register(method: type[Method]) -> type[Method]:
    """Add ``method`` to the registry under its name (a class decorator); a name taken is refused."""
    if method.name in METHODS:
        raise ValueError(f"a merge method named {method.name!r} is registered already ({METHODS[method.name]})")
    METHODS[method.name] = method
    return method


def method(name: str, **parameters: Any) -> Method:
    """The registered method ``name`` with its ``parameters``.

    Raises:
        ValueError: no method of that name (the error lists those registered).
    """
    if name not in METHODS:
        raise ValueError(f"no merge method named {name!r}: the methods are {', '.join(METHODS)}")
    return METHODS[name](**parameters)


def given(keywords: dict[str, Any]) -> list[Method]:
    """The methods ``keywords`` (``{keyword: value}``, a value None where not given) name, in the
    registry's order: each registered method whose keyword has a value, built with it."""
    return [
        cls(**{cls.parameter: keywords[cls.keyword]})
        for cls in METHODS.values()
        if cls.keyword is not None and keywords.get(cls.keyword) is not None
    ]


def normalised(weights: list[float]) -> list[float]:
    """``weights`` (finite, >= 0) scaled to sum to 1, refused where they sum to 0."""
    if not all(w >= 0 for w in weights):
        raise ValueError(f"weights must be >= 0 to be normalised, got {weights}: pass normalize=False (--raw-weights)")
    top = max(weights)
    if top > sys.float_info.max / len(weights):  # (their sum would overflow: the same shares, scaled down)
        weights = [w / top for w in weights]
    total = math.fsum(weights)
    if not total > 0:
        raise ValueError(f"weights {weights} sum to {total}: at least one must be positive")
    return [w / total for w in weights]


@register
@dataclass(frozen=True)
class Uniform(Method):
    """Every input alike (the default): LAWA, a model soup."""

    name: ClassVar[str] = "uniform"

    def shares(self, steps: Sequence[int], accumulate: torch.dtype) -> list[float]:
        return [1.0 / len(steps)] * len(steps)


@register
@dataclass(frozen=True)
class Weights(Method):
    """The weights given, one per input: normalised to sum to 1 (each >= 0), or with ``normalize``
    off taken as they are, negative ones too (task arithmetic: ``--weights 1 1 -1 --raw-weights``)."""

    name: ClassVar[str] = "weights"
    keyword: ClassVar[str | None] = "weights"
    parameter: ClassVar[str] = "weights"
    option: ClassVar[dict[str, Any]] = {
        "type": float, "nargs": "+", "metavar": "W", "help": "one per input, normalised to sum 1",
    }  # fmt: skip

    weights: Sequence[float]
    normalize: bool = True

    def as_given(self) -> Method:
        return replace(self, normalize=False)

    def shares(self, steps: Sequence[int], accumulate: torch.dtype) -> list[float]:
        weights, count = list(self.weights), len(steps)
        if len(weights) != count:
            raise ValueError(f"{len(weights)} weights for {count} inputs: give one per input")
        numbers = (isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
        if not all(numbers) or not all(math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be finite numbers, got {weights}")
        if self.normalize:
            return normalised(weights)
        largest = torch.finfo(accumulate).max
        if any(abs(w) > largest for w in weights):
            raise ValueError(
                f"weights {weights} reach beyond {dtype_name(accumulate)}'s range (up to {largest:.6g}), in which the "
                "merge accumulates: give smaller weights, or accumulate in float64 (--accumulate float64)"
            )
        return [float(w) for w in weights]


@register
@dataclass(frozen=True)
class Ema(Method):
    """An EMA of ``decay`` per step over the saved steps: step ``s`` weighted by
    ``decay ** (newest - s)``, normalised (what such an EMA gives each saved step, relative to the
    others)."""

    name: ClassVar[str] = "ema"
    keyword: ClassVar[str | None] = "ema"
    parameter: ClassVar[str] = "decay"
    option: ClassVar[dict[str, Any]] = {
        "type": float, "metavar": "DECAY", "help": "weight step s by DECAY**(newest - s): an EMA over the saved steps",
    }  # fmt: skip
    needs_steps: ClassVar[bool] = True

    decay: float

    def shares(self, steps: Sequence[int], accumulate: torch.dtype) -> list[float]:
        decay = self.decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"ema must be a decay in (0, 1), got {decay!r}")
        newest = max(steps)
        weights = [decay ** (newest - step) for step in steps]
        return Weights(weights).shares(steps, accumulate)


@register
@dataclass(frozen=True)
class Wsm(Method):
    """The weights whose average of checkpoints taken at ``steps`` under a constant learning rate is
    the model a decay of the learning rate by ``schedule`` over those steps would give (WSM).

    The average sum(c_i x_i) moves from the weights before the window by the sum over segments of
    (the weights of checkpoints at or after the segment) times (the segment's update), so it gives
    segment i the learning-rate multiplier c_i + ... + c_n. Setting that to the decay at the
    segment's start, ``decay(x_{i-1})``, gives c_i = decay(x_{i-1}) - decay(x_i), where x_i is
    checkpoint i's progress through the window. The window starts one interval (the checkpoints'
    mean spacing) before the oldest step and ends at the newest, so evenly spaced checkpoints sit at
    x_i = i / n. The weights sum to decay(0) - decay(1) = 1; linear decay is the uniform average."""

    name: ClassVar[str] = "wsm"
    keyword: ClassVar[str | None] = "schedule"
    parameter: ClassVar[str] = "schedule"
    option: ClassVar[dict[str, Any]] = {
        "choices": tuple(DECAYS),
        "help": "the weights that make the merge what this learning-rate decay over the inputs' steps gives (WSM)",
    }
    needs_steps: ClassVar[bool] = True

    schedule: Schedule  # type: ignore[misc]  # (the method's field: which decay)

    def shares(self, steps: Sequence[int], accumulate: torch.dtype) -> list[float]:
        return schedule_weights(self.schedule, steps)


def schedule_weights(schedule: Schedule, steps: Sequence[int]) -> list[float]:
    """``Wsm(schedule)``'s shares of checkpoints taken at ``steps`` (see ``Wsm``)."""
    if schedule not in DECAYS:
        raise ValueError(f"schedule must be one of {sorted(DECAYS)}, got {schedule!r}")
    order = sorted(range(len(steps)), key=lambda i: steps[i])
    ordered = [steps[i] for i in order]
    spacing = (ordered[-1] - ordered[0]) / (len(ordered) - 1) if len(ordered) > 1 else 1.0
    start, end = ordered[0] - spacing, ordered[-1]
    progress = [0.0] + [(step - start) / (end - start) for step in ordered]
    decay = DECAYS[schedule]
    weights = [0.0] * len(steps)
    for position, index in enumerate(order):
        weights[index] = decay(progress[position]) - decay(progress[position + 1])
    return weights


def checked_steps(chosen: Method, keyword: str, steps: Sequence[int | None], names: Sequence[str]) -> None:
    """Refuse inputs a method that needs steps cannot weigh: one recording none (``names``: each
    input, as messages name it), or two at one step."""
    if not chosen.needs_steps:
        return
    unknown = [name for name, step in zip(names, steps) if step is None]
    if unknown:
        raise CheckpointError(f"{keyword} weights need each input's step; these record none: {unknown}")
    if len(set(steps)) < len(steps):
        raise CheckpointError(f"{keyword} weights need distinct steps; the inputs' steps are {list(steps)}")
