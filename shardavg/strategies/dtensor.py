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

from ..errors import StrategyError
from ..parts import Part

KNOWN = (Replicate, Shard, _StridedShard)


def is_dtensor(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the same object at every call, unlike ``to_local()``, which
    makes a new alias each time), or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


_LOCAL = operator.attrgetter("_local_tensor")


def local_views(tensors: list[torch.Tensor], all_dtensors: bool) -> list[torch.Tensor]:
    """``local_view`` of each, at C speed when every one is a DTensor (read at every update)."""
    return list(map(_LOCAL, tensors)) if all_dtensors else [local_view(tensor) for tensor in tensors]


def dtensor_part(name: str, tensor: DTensor, kind: str) -> Part:
    """The part of the DTensor parameter or buffer ``name`` that this rank's local shard holds."""
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
    indices = [_indices(size, mesh, tuple(_along(placements, d))) for d, size in enumerate(tensor.shape)]
    part = Part.grid(tensor.shape, indices)
    local = tensor._local_tensor
    if local.numel() != part.numel or tuple(local.shape) != tuple(len(i) for i in indices):
        raise StrategyError(
            f"{kind} {name!r}: its local shard is {tuple(local.shape)}, but its placements {tensor.placements} "
            f"on a mesh of {tuple(tensor.device_mesh.shape)} give this rank {tuple(len(i) for i in indices)}"
        )
    return part


def _along(placements: tuple[Placement, ...], dim: int) -> list[Placement]:
    """The placements of a 1-D tensor that is sharded like dimension ``dim`` of the tensor."""
    return [
        (_StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0))
        if isinstance(p, (Shard, _StridedShard)) and p.dim == dim
        else Replicate()
        for p in placements
    ]


@functools.lru_cache(maxsize=4096)
def _indices(size: int, mesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """The global indices along one dimension of ``size`` that this rank's shard holds, in order."""
    if all(isinstance(p, Replicate) for p in placements):
        return tuple(range(size))
    return tuple(distribute_tensor(torch.arange(size), mesh, list(placements), src_data_rank=None).to_local().tolist())
