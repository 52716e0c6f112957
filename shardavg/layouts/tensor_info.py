"""What a strategy says of one tensor: its names, kind, global shape and dtype, and the part of it
this rank's local shard holds (with every rank's layout, where the engine's rule tells).

It is the one record the layouts, the update and the checkpoints all read, so it lives here with
``Part`` and ``TensorLayout``, below the strategies that make it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .parts import Part
from .tensor_layout import TensorLayout

TensorKind = Literal["param", "buffer"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the plain model and the part of it this rank holds.

    Attributes:
        name: Its canonical name in the plain model.
        aliases: Other names of the same tensor (tied weights).
        kind: ``"param"`` or ``"buffer"``.
        shape: The global shape.
        dtype: The dtype of its local shard (fp32 for DeepSpeed masters).
        requires_grad: Whether it is a trained parameter (False for buffers).
        part: What of the global tensor this rank's local shard holds.
        layout: Every rank's part, where the engine's rule tells; None: found by a gather.
    """

    name: str
    aliases: tuple[str, ...]
    kind: TensorKind
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    part: Part
    layout: TensorLayout | None = None

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        return self.shape.numel()

    @property
    def local_numel(self) -> int:
        """Elements of this rank's part (and of its local shard)."""
        return self.part.numel

    @property
    def names(self) -> tuple[str, ...]:
        """Its name, then its aliases."""
        return (self.name, *self.aliases)
