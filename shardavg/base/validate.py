"""The checks every argument that enters shardavg goes through, each with its one message.

A bad value is refused where it enters, naming the argument and what it got, before anything
changes: counts (a bool is not an int), floating dtypes, devices, average names, and the
choices of a ``Literal`` setting.
"""

from __future__ import annotations

import operator
import re
from typing import Any, get_args

import torch

AVERAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")  # never a dot or a slash: names join keys
RUN_ID = re.compile(r"^[0-9a-f]{32}$")  # a run's identity, in the checkpoints it writes


def count(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """``value`` is an int (not a bool) of at least ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not is_count(value, minimum):
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


def step(name: str, value: Any) -> int:
    """A step count: anything ``operator.index`` takes (numpy integers too) but a bool, >= 0."""
    if isinstance(value, bool):  # (an int to Python: True would be step 1)
        raise ValueError(f"{name}: a step is an int >= 0, got {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{name}: a step is >= 0, got {value}")
    return value


def floating_dtype(name: str, value: Any, optional: bool = True) -> None:
    """``value`` is a floating ``torch.dtype`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{name} must be a floating torch.dtype{' or None' if optional else ''}, got {value!r}")


def device(name: str, value: Any) -> torch.device | None:
    """``value`` as a ``torch.device`` (None stays None): the CPU, or this machine's accelerator at
    an index it has, given as a string or a ``torch.device``. torch itself takes ``"meta"``, or a
    CUDA device a CPU machine lacks, and fails only where the first tensor is placed there (an
    export, hours in), or refuses ``123`` in words that never name the option: refused here instead."""
    if value is None:
        return None
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    count = torch.accelerator.device_count() if accelerator is not None else 0
    try:
        parsed = torch.device(value) if isinstance(value, (str, torch.device)) else None
    except RuntimeError:  # (not a device string)
        parsed = None
    on_accelerator = accelerator is not None and parsed is not None and parsed.type == accelerator.type
    if parsed is not None and (parsed.type == "cpu" or (on_accelerator and (parsed.index or 0) < count)):
        return parsed
    kinds = (
        f", 'cpu' or {accelerator.type!r} ({accelerator.type}:0 to {accelerator.type}:{count - 1} exist here)"
        if accelerator is not None
        else " or 'cpu' (this machine has no accelerator torch can use)"
    )
    raise ValueError(
        f"{name}={value!r} is not a device of this machine: use None (each shadow beside its local shard){kinds}, "
        "as a string or torch.device"
    )


def choice(name: str, value: Any, choices: Any) -> None:
    """``value`` is one of a ``Literal`` type's values (or of a tuple)."""
    allowed = get_args(choices) or tuple(choices)
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")


def run_id(value: Any) -> None:
    if value is not None and not (isinstance(value, str) and RUN_ID.match(value)):
        raise ValueError(f"run_id must be 32 lower-case hex digits or None, got {value!r}")


def average_names(names: list[Any]) -> None:
    """Names of several averages: plain words that can join checkpoint keys."""
    bad = [name for name in names if not (isinstance(name, str) and AVERAGE_NAME.match(name))]
    if bad:
        raise ValueError(
            f"average names {bad!r} are not plain names: use letters, digits, '_' and '-' (no dots or slashes, "
            "which join checkpoint keys), starting with a letter or '_', at most 64 characters"
        )


def is_count(value: Any, minimum: int = 0) -> bool:
    """Whether ``value`` is an int (a bool is not) of at least ``minimum``: the one test of a count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def nesting(value: Any, limit: int) -> int:
    """How many arrays and objects deep parsed JSON ``value`` goes (0 for a scalar), counted
    without recursion and given up just past ``limit``: what is refused past a limit can never make
    a later recursive walk (showing it, writing it again) overflow the stack."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
