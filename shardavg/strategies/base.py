"""What every strategy adapter answers: which tensors there are, and where this rank's shard is.

An adapter lists each tensor of the plain (unwrapped) model once, as a ``TensorInfo``: its
canonical name and aliases, global shape and dtype, and the ``Part`` of the global tensor that
this rank's *local view* holds (``parts.py``: boxes of the global tensor; a flat range
``[start, end)`` of the flattened tensor is the one-dimensional case). The local view is a
tensor the engine already owns (a DTensor's local shard, the real part of a ZeRO-3 partition,
a slice of an FSDP1 flat parameter, or the tensor itself) with exactly ``part.numel``
elements. Everything else (averaging, swapping, gathering, checkpoints) is built on these two
answers.
"""

from __future__ import annotations

import functools
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..dist import world_size
from ..parts import Part
from ..tensor_layout import Grid, MeshLayout, TensorLayout, make_grid, world_grid
from .dtensor import dtensor_layout, dtensor_part, is_dtensor, local_view

TensorKind = Literal["param", "buffer"]

# Submodule names that wrappers insert into parameter paths (FSDP1, activation checkpointing,
# torch.compile); the plain model has none of them.
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def canonical_name(name: str) -> str:
    """The name a tensor has in the plain model: the dotted path without wrapper segments.

    Whole segments only, wherever they stand (also last, as in the path of an FSDP unit that
    wraps a checkpointed block), as torch's DCP does: ``enc_orig_mod.weight`` is left alone.
    """
    return ".".join(segment for segment in name.split(".") if segment not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the plain model and the part of it this rank holds."""

    name: str
    aliases: tuple[str, ...]  # other names of the same tensor (tied weights)
    kind: TensorKind
    shape: torch.Size  # global shape
    dtype: torch.dtype
    requires_grad: bool
    part: Part  # what of the global tensor this rank's local view holds
    layout: TensorLayout | None = None  # every rank's part, where the engine's rule tells (None: gathered)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def local_numel(self) -> int:
        return self.part.numel

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def is_deepspeed_engine(model: object) -> bool:
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def _is_compiled(model: object) -> bool:
    if "torch._dynamo" not in sys.modules:  # torch.compile was never called
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def unwrap(model: nn.Module) -> nn.Module:
    """Peel DDP, DeepSpeedEngine and torch.compile wrappers off the user's model."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel) or is_deepspeed_engine(model):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def grouped_by_identity(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[list[str], torch.Tensor]]:
    """Group names that refer to the same tensor object (tied weights), first name first."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), ([], tensor))[0].append(canonical_name(name))
    return list(groups.values())


def persistent_buffers(module: nn.Module) -> list[tuple[list[str], nn.Module, str, torch.Tensor]]:
    """Buffers that ``module.state_dict()`` holds, once each: (canonical names, owner, name in the owner, buffer).

    The owner and name say where to read the buffer again: ``model.to(...)`` replaces buffer
    tensors in their owners' dicts without telling anyone. A buffer is held whole, unless it is a
    DTensor (then read through its local shard, as a parameter).
    """
    found: dict[int, tuple[list[str], nn.Module, str, torch.Tensor]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                full_name = f"{prefix}.{name}" if prefix else name
                found.setdefault(id(buffer), ([], owner, name, buffer))[0].append(canonical_name(full_name))
    return list(found.values())


@functools.lru_cache(maxsize=64)
def group_grid(group: Any) -> Grid:
    """A process group's ranks as a 1-d grid (the default group's when ``group`` is None)."""
    if group is None or group is dist.group.WORLD:
        return world_grid(world_size())
    return make_grid((dist.get_world_size(group),), dist.get_process_group_ranks(group))


def everywhere(shape: Sequence[int]) -> MeshLayout:
    """The layout of a tensor every rank holds whole (a replica, a buffer)."""
    return MeshLayout(tuple(shape), world_grid(world_size()), (("replicate",),))


def tensor_info(
    names: list[str],
    tensor: torch.Tensor,
    kind: TensorKind,
    part: Part | None = None,
    layout: TensorLayout | None = None,
) -> TensorInfo:
    """Info for ``tensor`` (its global shape and dtype), of which this rank holds ``part`` of
    ``layout``: by default all of it, as every rank does (replicated parameters, buffers)."""
    return TensorInfo(
        name=names[0],
        aliases=tuple(names[1:]),
        kind=kind,
        shape=tensor.shape,
        dtype=tensor.dtype,
        requires_grad=kind == "param" and tensor.requires_grad,
        part=Part.whole(tensor.shape) if part is None else part,
        layout=everywhere(tensor.shape) if part is None else layout,
    )


def held_info(names: list[str], tensor: torch.Tensor, kind: TensorKind) -> TensorInfo:
    """Info for ``tensor`` as this rank holds it: a DTensor's local shard, or the whole tensor."""
    if is_dtensor(tensor):
        return tensor_info(names, tensor, kind, dtensor_part(names[0], tensor, kind), dtensor_layout(tensor))
    return tensor_info(names, tensor, kind)


class Strategy(ABC):
    """What the averager asks of an engine: the tensors, and this rank's local view of each."""

    name: ClassVar[str]
    # Whether ``swapped()`` must gather the average: the forward reads whole tensors of which
    # this rank averages a part (ZeRO-1/2 masters). It is then a collective.
    swap_gathers: ClassVar[bool] = False
    model: nn.Module  # what the user passed (its modules are watched for replaced parameters)

    @abstractmethod
    def tensors(self) -> list[TensorInfo]:
        """Scan the model: every tensor of the plain model once, with the part of it this rank holds.
        ``local_views()`` answers for the latest scan; rescan after the model's structure changed."""

    @abstractmethod
    def local_views(self) -> list[torch.Tensor]:
        """Current local views aligned with the latest ``tensors()``. Called every update: keep it
        cheap, and return the same tensor objects while the engine keeps its storage (the
        averager regroups its fused updates whenever a view is a new object)."""

    def swap_views(self) -> list[torch.Tensor]:
        """What ``swapped()`` writes the average into: the tensors the forward reads. The local
        views, except where the average is taken from elsewhere (ZeRO-3's fp32 master partitions)."""
        return self.local_views()

    def release_gathered(self) -> None:
        """Drop full (unsharded) copies of parameters, so the next forward gathers the local shards.

        Called before weights are swapped in and after they are swapped back.
        """


class ModuleStrategy(Strategy):
    """An adapter for one model held by one engine: its parameters as the engine holds them
    (``_scan_params``, ``_param_views``), then its persistent buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.module = unwrap(model)
        self._buffer_slots: list[tuple[nn.Module, str]] | None = None  # set by tensors(): no views before a scan

    @staticmethod
    @abstractmethod
    def fits(model: nn.Module) -> bool:
        """Whether this adapter understands how ``model`` holds its parameters."""

    @abstractmethod
    def _scan_params(self) -> list[TensorInfo]:
        """List the parameters (once each) and remember how to reach their local views."""

    @abstractmethod
    def _param_views(self) -> list[torch.Tensor]:
        """The parameters' current local views, in ``_scan_params`` order (see ``local_views``)."""

    def tensors(self) -> list[TensorInfo]:
        """Every parameter, then every persistent buffer (whole, unless a DTensor)."""
        infos = self._scan_params()
        buffers = persistent_buffers(self.module)
        self._buffer_slots = [(owner, name) for _, owner, name, _ in buffers]
        infos += [held_info(names, buffer, "buffer") for names, _, _, buffer in buffers]
        return infos

    def local_views(self) -> list[torch.Tensor]:
        if self._buffer_slots is None:
            raise RuntimeError(f"{type(self).__name__}.local_views() before tensors(): scan the model first")
        return self._param_views() + [local_view(owner._buffers[name]) for owner, name in self._buffer_slots]
