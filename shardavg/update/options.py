"""An averager's settings, checked where they enter, and what they decide: each tensor's role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..base import validate
from ..base.dtypes import dtype_name
from ..layouts.tensor_info import TensorInfo

Role = Literal["average", "copy", "live"]  # averaged; copied at each update; not stored (live value exported)
BufferPolicy = Literal["copy", "average", "ignore"]
NonfinitePolicy = Literal["raise", "skip", "off"]


@dataclass(frozen=True)
class Options:
    """How an averager averages: the settings ``WeightAverager`` takes besides the model and the rule.

    Each option is documented here, once; ``WeightAverager`` passes its arguments of the same
    names through, and ``avg.options`` gives them back. A value out of its range is refused on
    construction, naming it.

    Attributes:
        every_n_steps: Update every ``every_n_steps`` optimizer steps, counted from ``start_step``.
            Default 1 (every step).
        start_step: The first step that updates; that update copies the live weights. Default 0.
        dtype: Shadow dtype of floating tensors. The default, ``torch.float32``, averages
            bf16/fp16 weights without rounding each update; ``None`` keeps the live dtype.
        buffers: ``"copy"`` (default: the live value at each update), ``"average"`` (floating
            buffers averaged, integer ones copied) or ``"ignore"`` (not stored: exports carry the
            live value).
        device: Where the shadows live: ``None`` (default) next to each live shard, ``"cpu"`` (or
            any device) offloaded there. A string is converted to a ``torch.device``.
        include_frozen: Also average parameters with ``requires_grad=False``; by default (False)
            they are not stored and exports carry their live values.
        on_nonfinite: What a NaN or infinity in a live weight does: ``"raise"`` (default) raises
            ``NonFiniteError`` and ``"skip"`` warns, both leaving the average untouched; ``"off"``
            skips the check (one read of every live shard less per update) and averages whatever
            is there.
        background: Run each update on a thread of its own (default False): ``update()`` returns
            once it has copied the buffers; the next optimizer step, and every reader of the
            averages, waits for it; an error it meets is raised at the next call. The averages are
            bitwise those of the update in the loop.

    Raises:
        ValueError: An option out of its range or not one of its choices.
    """

    every_n_steps: int = 1
    start_step: int = 0
    dtype: torch.dtype | None = torch.float32
    buffers: BufferPolicy = "copy"
    device: torch.device | None = None
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
        """What the averager does with one tensor under these options.

        Args:
            info: The tensor, as the strategy adapter lists it.

        Returns:
            ``"average"`` (averaged by the rule), ``"copy"`` (its live value copied at each
                update) or ``"live"`` (not stored: exports carry the live value).
        """
        if info.kind == "param":
            return "average" if info.requires_grad or self.include_frozen else "live"
        if self.buffers == "ignore":
            return "live"
        if self.buffers == "average" and info.dtype.is_floating_point:
            return "average"
        return "copy"

    def due(self, step: int) -> bool:
        """Whether an update runs at ``step``: ``start_step``, then every ``every_n_steps``.

        Args:
            step: An optimizer step count.

        Returns:
            True when ``step`` is ``start_step + k * every_n_steps`` for some ``k >= 0``.
        """
        return step >= self.start_step and not (step - self.start_step) % self.every_n_steps

    def describe(self) -> dict[str, Any]:
        """The options that shape the saved average, as plain data (recorded in each checkpoint).

        Returns:
            ``every_n_steps``, ``start_step``, ``dtype`` (by name, or None), ``buffers`` and
                ``include_frozen``.
        """
        return {
            "every_n_steps": self.every_n_steps,
            "start_step": self.start_step,
            "dtype": None if self.dtype is None else dtype_name(self.dtype),
            "buffers": self.buffers,
            "include_frozen": self.include_frozen,
        }
