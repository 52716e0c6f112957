"""An averager's settings, checked where they enter, and what they decide: each tensor's role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import validate
from .storage import dtype_name
from .strategies.base import TensorInfo

Role = Literal["average", "copy", "live"]  # averaged; copied at each update; not stored (live value exported)
BufferPolicy = Literal["copy", "average", "ignore"]
NonfinitePolicy = Literal["raise", "skip", "off"]


@dataclass(frozen=True)
class Options:
    """How an averager averages; a value out of its range is refused on construction, naming it.

    Attributes:
        every_n_steps: update every ``every_n_steps`` steps from ``start_step``.
        start_step: the first step that updates (it copies the live weights).
        dtype: shadow dtype of floating tensors (fp32 default, so bf16/fp16 weights are
            averaged without rounding each update); ``None`` keeps the live dtype.
        buffers: ``"copy"`` (the live value at each update), ``"average"`` (floating buffers
            averaged, integer ones copied) or ``"ignore"`` (exports carry the live value).
        device: where shadows live; ``None`` next to each live shard, ``"cpu"`` offloaded.
        include_frozen: also average parameters with ``requires_grad=False`` (otherwise they
            are exported with their live values).
        on_nonfinite: ``"raise"`` (default) or ``"skip"`` (warn and leave the average
            untouched) when a live weight holds NaN or infinity; ``"off"`` skips the check
            (one read of every live shard less per update) and averages whatever is there.
        background: run each update on a thread of its own (``background.py``): ``update()``
            returns once it has copied the buffers; the next optimizer step, and every reader of
            the averages, waits for it; an error it meets is raised at the next call. The
            averages are bitwise those of the update in the loop.
    """

    every_n_steps: int = 1
    start_step: int = 0
    dtype: torch.dtype | None = torch.float32  # of averaged floating shadows; None: the live dtype
    buffers: BufferPolicy = "copy"
    device: torch.device | None = None  # where shadows live; None: next to each live shard
    include_frozen: bool = False
    on_nonfinite: NonfinitePolicy = "raise"
    background: bool = False

    def __post_init__(self) -> None:
        validate.count("every_n_steps", self.every_n_steps, 1)
        validate.count("start_step", self.start_step, 0)
        validate.floating_dtype("dtype", self.dtype)
        validate.choice("buffers policy", self.buffers, BufferPolicy)
        validate.choice("on_nonfinite policy", self.on_nonfinite, NonfinitePolicy)
        if not isinstance(self.background, bool):
            raise ValueError(f"background must be True or False, got {self.background!r}")
        if self.device is not None and not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))

    def role(self, info: TensorInfo) -> Role:
        if info.kind == "param":
            return "average" if info.requires_grad or self.include_frozen else "live"
        if self.buffers == "ignore":
            return "live"
        if self.buffers == "average" and info.dtype.is_floating_point:
            return "average"
        return "copy"

    def due(self, step: int) -> bool:
        """Whether an update runs at ``step``: ``start_step``, then every ``every_n_steps``."""
        return step >= self.start_step and not (step - self.start_step) % self.every_n_steps

    def describe(self) -> dict[str, Any]:
        return {
            "every_n_steps": self.every_n_steps,
            "start_step": self.start_step,
            "dtype": None if self.dtype is None else dtype_name(self.dtype),
            "buffers": self.buffers,
            "include_frozen": self.include_frozen,
        }
