"""The averager as a ``torch.distributed.checkpoint`` Stateful: ``dcp.save({..., "ema": avg})``.

Every tensor is offered in its global shape (a 0-d tensor as one element), of which this rank
holds the boxes of the part it owns, one local shard each (a DTensor over
``LocalShardsWrapper``, the wrapper torchrec uses for arbitrary shards): DCP's own resharding
then loads it under any layout, world size or strategy, as ``avg.save`` does. The description
(counters, rule, names, shapes) travels as a JSON string.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..base.dist import agree_or_raise, distributed, rank
from ..base.errors import CheckpointError
from ..checkpoints.description import Description
from ..checkpoints.format import decode_description, encode_description
from .average_state import AverageState
from .checkpoint import ToLoad, check_compatible, loadable


def dcp_shape(shape: torch.Size) -> torch.Size:
    """The shape a tensor is stored under in DCP: its own, a 0-d tensor's as one element."""
    return shape if len(shape) else torch.Size([1])


def _offered(state: AverageState, index: int, local: torch.Tensor) -> list[torch.Tensor]:
    """The local shards this rank offers DCP for tensor ``index``, as views of its ``local``: the
    boxes of the part it owns (none for a replica), or in one process the whole tensor."""
    info = state.infos[index]
    if not distributed():
        return [local.view(dcp_shape(info.shape))]
    if not state.layout.owns(index, rank()):
        return []
    if not len(info.shape):  # a 0-d tensor: one element
        return [local.view(1)]
    return [block.view(local) for block in info.part.blocks]


def _dcp_value(state: AverageState, index: int, average: str | None, meshes: dict[str, Any]) -> torch.Tensor:
    """Tensor ``index`` of ``average`` as DCP sees it: the global tensor, of which this rank offers
    the boxes it owns. Replicas offer nothing (DCP would keep an arbitrary replica's copy of, say,
    a BatchNorm buffer); ``load_state_dict`` sends them the owner's part."""
    info = state.infos[index]
    shape = dcp_shape(info.shape)
    local = state.flat_part(index, average)
    if not state.stored(index):
        local = local.clone()  # a live value: loading must not write into the model
    shards = _offered(state, index, local)
    if not distributed():
        return shards[0]
    offsets = [(0,)] if not len(info.shape) else [block.offsets for block in info.part.blocks]
    if not shards:  # an empty shard at the far corner can never be mistaken for another rank's
        shards, offsets = [local.new_empty((0,) * len(shape))], [tuple(shape)]
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if local.device.type not in meshes:  # one mesh over all ranks per device type
        meshes[local.device.type] = DeviceMesh.from_group(dist.group.WORLD, local.device.type)
    stride = torch.empty(shape, device="meta").stride()
    wrapped = LocalShardsWrapper(shards, offsets)
    return DTensor.from_local(
        wrapped, meshes[local.device.type], [Shard(0)], run_check=False, shape=shape, stride=stride
    )


def _fill_replicas(state: AverageState, slots: list[ToLoad]) -> None:
    """Collective: every rank holding a copy of a part it does not own receives the owner's."""
    if not distributed():
        return
    me = rank()
    for slot in slots:
        for owner, part in state.layout.owned(slot.index):
            holders = state.layout.replicas(slot.index, owner)
            if not holders:
                continue
            shadow = state.flat_part(slot.index, slot.average)
            if me == owner or me in holders:
                dist.broadcast(shadow, src=owner)
            else:  # takes part without a copy of its own
                dist.broadcast(shadow.new_empty(part.numel), src=owner)


def state_dict(state: AverageState) -> dict[str, Any]:
    state.verify_structure()
    meshes: dict[str, Any] = {}
    return {
        "meta": encode_description(state.describe()),
        "tensors": {
            key: _dcp_value(state, index, average, meshes)
            for index in range(len(state.infos))
            for key, average in state.keys(index)
        },
    }


def _local_shards(value: Any) -> list[Any]:
    """The local shards DCP filled: of a DTensor over ``LocalShardsWrapper``, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if hasattr(value, "local_shards"):  # LocalShardsWrapper
        return list(value.local_shards())
    return [value]


def load_state_dict(state: AverageState, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Check the whole state dict (description, names, shapes, dtypes) on every rank first, the
    ranks agreeing, then restore (a rank that refused makes every rank raise, none waits)."""
    error: BaseException | None = None
    try:
        saved, slots, values = _checked(state, state_dict, strict)
    except Exception as caught:
        error = caught
    agree_or_raise(error, "loading the averager's state dict")
    with torch.no_grad():
        for target, shard in values:
            if shard.data_ptr() != target.data_ptr():  # DCP loaded into the shadow itself otherwise
                target.copy_(shard)
        _fill_replicas(state, slots)
    state.resume(saved, {slot.key for slot in slots})


def _checked(
    state: AverageState, state_dict: dict[str, Any], strict: bool
) -> tuple[Description, list[ToLoad], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The description, the slots to fill and ``(target, loaded shard)`` pairs, everything checked."""
    if not isinstance(state_dict, dict) or "meta" not in state_dict or not isinstance(state_dict.get("tensors"), dict):
        raise CheckpointError("not a shardavg state dict: it needs 'meta' and a 'tensors' dict")
    saved = decode_description(state_dict["meta"], "state dict")
    slots = loadable(state, check_compatible(state, saved, "the state dict", strict), saved)
    tensors = state_dict["tensors"]
    absent = sorted(slot.key for slot in slots if slot.key not in tensors)
    if absent:
        message = f"the state dict describes {absent} but its 'tensors' lack them"
        if strict:
            raise CheckpointError(f"{message}; pass strict=False to average them from the live weights on")
        warnings.warn(f"{message}: averaged from the live weights on", stacklevel=4)
    slots = [slot for slot in slots if slot.key in tensors]
    values = []
    for slot in slots:
        targets = _offered(state, slot.index, state.flat_part(slot.index, slot.average))
        if not targets:
            continue  # a replica: the owner sends it its part
        shards = _local_shards(tensors[slot.key])
        found = [f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in shards]
        wanted = [f"{t.dtype} {tuple(t.shape)}" for t in targets]
        if found != wanted:
            raise CheckpointError(
                f"{slot.key!r}: the state dict holds {found} here, this rank holds {wanted}; load through "
                "torch.distributed.checkpoint to reshard"
            )
        values += list(zip(targets, shards))
    return saved, slots, values
