"""DTensors under any placements: which part of the global tensor a local shard holds.

A DTensor's local shard holds, along each dimension of the global tensor, the indices that its
placements give this rank: ``Shard(d)`` on any dim and on any number of mesh dims (FSDP2, HSDP,
row- and column-wise tensor parallel, expert parallel), ``_StridedShard`` (FSDP2 on top of
tensor parallel on the same dim), ``Replicate`` (the same part as the other replicas, which
the layout then tells apart by rank). The indices are computed by DTensor itself: an ``arange``
along each dim, distributed with the placements that act on that dim, locally
(``src_data_rank=None``: no communication), so the part is what DTensor does, uneven and empty
shards included. ``Partial`` (a reduction still pending: the local values are not the
tensor's) and placements this module does not know are refused, naming the tensor.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..base.errors import StrategyError
from ..layouts.parts import Part
from ..layouts.tensor_layout import Grid, MeshLayout, make_grid

KNOWN = (Replicate, Shard, _StridedShard)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor.

    Args:
        tensor: A tensor or parameter.

    Returns:
        Whether it is a DTensor.
    """
    return isinstance(tensor, DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself.

    The same object at every call, unlike ``to_local()``, which makes a new alias each time.

    Args:
        tensor: A DTensor or a plain tensor.

    Returns:
        Its local shard, or ``tensor``.
    """
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


_LOCAL = operator.attrgetter("_local_tensor")


def local_shards(tensors: list[torch.Tensor], all_dtensors: bool) -> list[torch.Tensor]:
    """``local_shard`` of each, at C speed when every one is a DTensor (read at every update).

    Args:
        tensors: Tensors, DTensors or not.
        all_dtensors: Whether every one is a DTensor (the caller knows it from its scan).

    Returns:
        Their local shards, in order.
    """
    return list(map(_LOCAL, tensors)) if all_dtensors else [local_shard(tensor) for tensor in tensors]


def dtensor_part(name: str, tensor: DTensor, kind: str) -> Part:
    """The part of the DTensor parameter or buffer ``name`` that this rank's local shard holds.

    Args:
        name: Its name, for error messages.
        tensor: The DTensor.
        kind: ``"param"`` or ``"buffer"``, for error messages.

    Returns:
        The part (uneven and empty shards included).

    Raises:
        StrategyError: A ``Partial`` or unknown placement, or a local shard whose shape does not
            match its placements.
    """
    for placement in tensor.placements:
        if placement.is_partial():
            raise StrategyError(
                f"{kind} {name!r} is Partial on its mesh ({tensor.placements}): its local values are not the "
                "tensor's until they are reduced, so they cannot be averaged; reduce it (redistribute to "
                "Replicate or Shard) before building the averager"
            )
        if type(placement) not in KNOWN:
            raise StrategyError(
                f"{kind} {name!r} has the placement {placement!r}, which shardavg does not know (it knows "
                f"{', '.join(cls.__name__ for cls in KNOWN)}): cannot tell which part of it this rank holds"
            )
    mesh, placements = tensor.device_mesh, tensor.placements
    ranges = [_ranges_along(size, mesh, tuple(_along(placements, d))) for d, size in enumerate(tensor.shape)]
    part = Part.from_ranges(tensor.shape, ranges)
    local, sizes = tensor._local_tensor, tuple(sum(length for _, length in dim) for dim in ranges)
    if local.numel() != part.numel or tuple(local.shape) != sizes:
        raise StrategyError(
            f"{kind} {name!r}: its local shard is {tuple(local.shape)}, but its placements {tensor.placements} "
            f"on a mesh of {tuple(tensor.device_mesh.shape)} give this rank {sizes}"
        )
    return part


def dtensor_layout(tensor: DTensor) -> MeshLayout:
    """The rule every rank's part of ``tensor`` follows: its placements on its mesh's grid of ranks.

    Checked against ``dtensor_part`` on each rank when the layout is built.

    Args:
        tensor: The DTensor.

    Returns:
        Its layout.
    """
    ndim = len(tensor.shape)
    grid, copies = grid_of(tensor.device_mesh)
    placements = [("replicate",)] if copies else []
    for placement in tensor.placements:
        if isinstance(placement, _StridedShard):
            placements.append(("strided_shard", placement.dim % max(ndim, 1), int(placement.split_factor)))
        elif isinstance(placement, Shard):
            placements.append(("shard", placement.dim % max(ndim, 1)))
        else:
            placements.append(("replicate",))
    return MeshLayout(tuple(tensor.shape), grid, tuple(placements))


@functools.lru_cache(maxsize=64)
def grid_of(mesh) -> tuple[Grid, bool]:
    """A device mesh's ranks as a grid, shared by its tensors' layouts (cached per mesh).

    A sub-mesh (``mesh["dp"]``) is one of several alike, one per index of the other dims of its
    root mesh, and the grid holds them all (so every rank describes a tensor on its own copy the
    same way), as DeviceMesh's own layout of the copies says.

    Args:
        mesh: A device mesh.

    Returns:
        The grid, and whether it has a leading dim of copies.
    """
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    full = mesh.mesh.unsqueeze(0) if layout is None or rank_map is None else layout.remap_to_tensor(rank_map)
    if full.shape[0] == 1:
        return make_grid(tuple(mesh.shape), full.flatten().tolist()), False
    return make_grid(tuple(full.shape), full.flatten().tolist()), True


def _along(placements: tuple[Placement, ...], dim: int) -> list[Placement]:
    """The placements of a 1-D tensor that is sharded like dimension ``dim`` of the tensor."""
    return [
        (_StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0))
        if isinstance(p, (Shard, _StridedShard)) and p.dim == dim
        else Replicate()
        for p in placements
    ]


@functools.lru_cache(maxsize=4096)
def _ranges_along(size: int, mesh, placements: tuple[Placement, ...]) -> tuple[tuple[int, int], ...]:
    """The global indices along one dimension of ``size`` that this rank's shard holds, in order,
    as ranges ``(first, length)`` of consecutive ones: DTensor's own split of an ``arange``, its ranges
    found by comparing neighbours (one pass in torch, not one step per index in Python)."""
    if all(isinstance(p, Replicate) for p in placements):
        return ((0, size),) if size else ()
    indices = distribute_tensor(torch.arange(size), mesh, list(placements), src_data_rank=None).to_local()
    if not indices.numel():
        return ()
    starts = [0, *(torch.nonzero(indices[1:] - indices[:-1] != 1).flatten() + 1).tolist(), indices.numel()]
    firsts = indices[starts[:-1]].tolist()
    return tuple((first, end - start) for first, start, end in zip(firsts, starts, starts[1:]))
