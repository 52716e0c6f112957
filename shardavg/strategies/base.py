"""What every strategy answers: which tensors there are, and where this rank's shard is.

A strategy lists each tensor of the plain (unwrapped) model once, as a ``TensorInfo``: its
canonical name and aliases, global shape and dtype, and the ``Part`` of the global tensor that
this rank's *local shard* holds (``layouts/parts.py``: boxes of the global tensor; a flat range
``[start, end)`` of the flattened tensor is the one-dimensional case). The local shard is a
tensor the engine already owns (a DTensor's local shard, the real part of a ZeRO-3 partition,
a flat range of an FSDP1 flat parameter, or the tensor itself) with exactly ``part.numel``
elements. Everything else (averaging, swapping, gathering, checkpoints) is built on these two
answers.
"""

from __future__ import annotations

import functools
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..base.dist import world_size
from ..layouts.parts import Part
from ..layouts.tensor_info import TensorInfo, TensorKind
from ..layouts.tensor_layout import Grid, MeshLayout, TensorLayout, make_grid, world_grid
from .dtensor import dtensor_layout, dtensor_part, is_dtensor, local_shard

# Submodule names that wrappers insert into parameter paths (FSDP1, activation checkpointing,
# torch.compile); the plain model has none of them.
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def canonical_name(name: str) -> str:
    """The name a tensor has in the plain model: the dotted path without wrapper segments.

    Whole segments only, wherever they stand (also last, as in the path of an FSDP unit that
    wraps a checkpointed block), as torch's DCP does: ``enc_orig_mod.weight`` is left alone.

    Args:
        name: A dotted parameter or buffer path, as the wrapped model names it.

    Returns:
        The path without ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module`` and ``_orig_mod``.
    """
    return ".".join(segment for segment in name.split(".") if segment not in WRAPPER_SEGMENTS)


def is_deepspeed_engine(model: object) -> bool:
    """Whether ``model`` is a ``DeepSpeedEngine`` (False, without importing it, when DeepSpeed is not loaded).

    Args:
        model: Anything.

    Returns:
        Whether it is a DeepSpeed engine.
    """
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
    """Peel DDP, DeepSpeedEngine and torch.compile wrappers off the user's model.

    Args:
        model: The model as the user holds it.

    Returns:
        The innermost module (FSDP1 units, which live inside the model, are kept).
    """
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel) or is_deepspeed_engine(model):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def grouped_by_identity(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[list[str], torch.Tensor]]:
    """Group names that refer to the same tensor object (tied weights), first name first.

    Args:
        named: ``(name, tensor)`` pairs, e.g. ``named_parameters(remove_duplicate=False)``.

    Returns:
        One ``(canonical names, tensor)`` per distinct tensor, in first-seen order.
    """
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), ([], tensor))[0].append(canonical_name(name))
    return list(groups.values())


def persistent_buffers(module: nn.Module) -> list[tuple[list[str], nn.Module, str, torch.Tensor]]:
    """Buffers that ``module.state_dict()`` holds, once each: (canonical names, owner, name in the owner, buffer).

    The owner and name say where to read the buffer again: ``model.to(...)`` replaces buffer
    tensors in their owners' dicts without telling anyone. A buffer is held whole, unless it is a
    DTensor (then read through its local shard, as a parameter).

    Args:
        module: The plain model.

    Returns:
        One ``(canonical names, owner module, name in the owner, buffer)`` per distinct buffer.
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
    """A process group's ranks as a 1-d grid (cached per group).

    Args:
        group: A process group; None or ``WORLD`` for the default group.

    Returns:
        The grid of its global ranks.
    """
    if group is None or group is dist.group.WORLD:
        return world_grid(world_size())
    return make_grid((dist.get_world_size(group),), dist.get_process_group_ranks(group))


def everywhere(shape: Sequence[int]) -> MeshLayout:
    """The layout of a tensor every rank holds whole (a replica, a buffer).

    Args:
        shape: The tensor's shape.

    Returns:
        A layout replicated over the whole world.
    """
    return MeshLayout(tuple(shape), world_grid(world_size()), (("replicate",),))


def tensor_info(
    names: list[str],
    tensor: torch.Tensor,
    kind: TensorKind,
    part: Part | None = None,
    layout: TensorLayout | None = None,
) -> TensorInfo:
    """Info for ``tensor`` (its global shape and dtype) of which this rank holds ``part``.

    Args:
        names: Its canonical name, then its aliases.
        tensor: The tensor, of its global shape.
        kind: ``"param"`` or ``"buffer"`` (only a parameter can require a gradient).
        part: What of it this rank holds; None (default): all of it, as every rank does
            (replicated parameters, buffers), with a replicated layout.
        layout: Every rank's part; used only with ``part``.

    Returns:
        The info.
    """
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
    """Info for ``tensor`` as this rank holds it: a DTensor's local shard, or the whole tensor.

    Args:
        names: Its canonical name, then its aliases.
        tensor: A DTensor or a plain tensor.
        kind: ``"param"`` or ``"buffer"``.

    Returns:
        The info.

    Raises:
        StrategyError: A DTensor with a ``Partial`` or unknown placement, or a local shard that does
            not match its placements.
    """
    if is_dtensor(tensor):
        return tensor_info(names, tensor, kind, dtensor_part(names[0], tensor, kind), dtensor_layout(tensor))
    return tensor_info(names, tensor, kind)


class Strategy(ABC):
    """What the averager asks of an engine: the tensors, and this rank's local shard of each.

    Attributes:
        name: The strategy's name, as ``strategy=`` and saved descriptions spell it.
        swap_gathers: Whether ``swapped()`` must gather the average (a collective): the forward
            reads whole tensors of which this rank averages a part (ZeRO-1/2 masters).
        copies_everywhere: Whether every rank holds a whole copy of every tensor, none of it
            placed by the engine, so that a collective read must first see that the copies agree
            (``replicated.refuse_unlike_values``): hand-written tensor parallelism looks the same.
        model: What the user passed (its modules are watched for replaced parameters).
    """

    name: ClassVar[str]
    swap_gathers: ClassVar[bool] = False
    copies_everywhere: ClassVar[bool] = False
    model: nn.Module

    @abstractmethod
    def tensors(self) -> list[TensorInfo]:
        """Scan the model: every tensor of the plain model once, with the part of it this rank holds.

        ``local_shards()`` answers for the latest scan; rescan after the model's structure changed.

        Returns:
            One info per tensor, in the same order on every rank.
        """

    @abstractmethod
    def local_shards(self) -> list[torch.Tensor]:
        """Current local shards aligned with the latest ``tensors()``.

        Called every update: keep it cheap, and return the same tensor objects while the engine
        keeps its storage (the averager regroups its fused updates whenever a view is a new object).
        Return the very list of the last call only where every tensor in it is the same object with
        its data where it was: the averager then skips reading each one's pointer (FSDP1's views).

        Returns:
            One tensor per info, of ``info.local_numel`` elements.
        """

    def swap_views(self) -> list[torch.Tensor]:
        """What ``swapped()`` writes the average into: the tensors the forward reads.

        Returns:
            The local shards, except where the average is taken from elsewhere (fp32 master
                partitions): there the live tensors.
        """
        return self.local_shards()

    def release_gathered(self) -> None:
        """Drop full (unsharded) copies of parameters, so the next forward gathers the local shards.

        Called before weights are swapped in and after they are swapped back.
        """


class ModuleStrategy(Strategy):
    """A strategy for one model held by one engine: its parameters as the engine holds them, then its buffers.

    Subclasses say how the engine holds parameters (``fits``, ``_scan_params``, ``_param_views``).

    Args:
        model: The model as the user passed it (wrappers are peeled off with ``unwrap``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.module = unwrap(model)
        self._buffer_slots: list[tuple[nn.Module, str]] | None = None  # set by tensors(): no views before a scan

    @staticmethod
    @abstractmethod
    def fits(model: nn.Module) -> bool:
        """Whether this strategy understands how ``model`` holds its parameters.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether it fits.
        """

    @abstractmethod
    def _scan_params(self) -> list[TensorInfo]:
        """List the parameters (once each) and remember how to reach their local shards."""

    @abstractmethod
    def _param_views(self) -> list[torch.Tensor]:
        """The parameters' current local shards, in ``_scan_params`` order (see ``local_shards``)."""

    def tensors(self) -> list[TensorInfo]:
        """Every parameter, then every persistent buffer (whole, unless a DTensor).

        Returns:
            One info per tensor (see ``Strategy.tensors``).
        """
        infos = self._scan_params()
        buffers = persistent_buffers(self.module)
        self._buffer_slots = [(owner, name) for _, owner, name, _ in buffers]
        infos += [held_info(names, buffer, "buffer") for names, _, _, buffer in buffers]
        return infos

    def local_shards(self) -> list[torch.Tensor]:
        """The parameters' local shards, then the buffers' (see ``Strategy.local_shards``).

        Returns:
            One tensor per info of the latest ``tensors()``.

        Raises:
            RuntimeError: Called before ``tensors()``.
        """
        buffers = self._buffer_shards()  # (first: it refuses a call before the scan)
        return self._param_views() + buffers

    def _buffer_shards(self) -> list[torch.Tensor]:
        """The persistent buffers' local shards, in ``tensors()``'s order."""
        if self._buffer_slots is None:
            raise RuntimeError(f"{type(self).__name__}.local_shards() before tensors(): scan the model first")
        return [local_shard(owner._buffers[name]) for owner, name in self._buffer_slots]
