"""The averager as a ``torch.distributed.checkpoint`` Stateful: ``dcp.save({..., "ema": avg})``.

Every tensor is offered as the *flattened* global tensor, of which this rank holds the chunk
it owns (a DTensor over ``LocalShardsWrapper``, the wrapper torchrec uses for arbitrary
shards), so ``dcp.load`` reshards it to any world size or strategy, the same way as
``avg.save``. The description (counters, rule, names, shapes) travels as a JSON string.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .checkpoint import _loadable, check_compatible, check_description, describe, restore_counters
from .errors import CheckpointError
from .layout import distributed, rank

if TYPE_CHECKING:
    from .averager import WeightAverager


def encode_description(meta: dict[str, Any]) -> str:
    """The description as a JSON string: DCP stores a plain ``str`` through ``torch.save``, which
    shardavg's offline reader loads back with ``weights_only=True`` (no Python objects)."""
    return json.dumps(meta)


def decode_description(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: 'meta' is {type(value).__name__}, not a shardavg description")
    try:
        meta = json.loads(value)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{where}: 'meta' is not valid JSON: {error}") from error
    return check_description(meta, where)


def _owns(avg: WeightAverager, index: int) -> bool:
    return any(owner == rank() for owner, _, _ in avg.layout.chunks[index])


def _dcp_value(avg: WeightAverager, index: int) -> torch.Tensor:
    """Tensor ``index`` as DCP sees it: the flattened global tensor, of which this rank offers
    the chunk it owns. Replicas offer nothing (DCP would keep an arbitrary replica's copy of,
    say, a BatchNorm buffer); ``load_state_dict`` sends them the owner's chunk."""
    info = avg._infos[index]
    piece, offset = avg._piece(index), info.start
    if not _owns(avg, index):  # an empty chunk at the end can never be mistaken for another rank's
        piece, offset = piece[:0], info.numel
    elif avg._shadows[index] is None:
        piece = piece.clone()  # a live value: loading must not write into the model
    if not distributed():
        return piece
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    mesh = avg._meshes.get(piece.device.type)
    if mesh is None:
        mesh = avg._meshes[piece.device.type] = DeviceMesh.from_group(dist.group.WORLD, piece.device.type)
    shards = LocalShardsWrapper([piece], [(offset,)])
    return DTensor.from_local(shards, mesh, [Shard(0)], run_check=False, shape=torch.Size([info.numel]), stride=(1,))


def _fill_replicas(avg: WeightAverager, indices: list[int]) -> None:
    """Collective: every rank holding a copy of a chunk it does not own receives the owner's."""
    if not distributed():
        return
    me = rank()
    for index in indices:
        ranges = avg.layout.ranges[index]
        for owner, start, end in avg.layout.chunks[index]:
            holders = [r for r, held in enumerate(ranges) if held == (start, end) and r != owner]
            if not holders:
                continue
            shadow = avg._shadows[index].view(-1)
            if me == owner or me in holders:
                dist.broadcast(shadow, src=owner)
            else:  # takes part without a copy of its own
                dist.broadcast(shadow.new_empty(end - start), src=owner)


def state_dict(avg: WeightAverager) -> dict[str, Any]:
    avg._verify_structure()
    return {
        "meta": encode_description(describe(avg)),
        "tensors": {info.name: _dcp_value(avg, index) for index, info in enumerate(avg._infos)},
    }


def _local_part(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value._local_tensor
    if hasattr(value, "local_shards"):  # LocalShardsWrapper
        (value,) = value.local_shards()
    return value


def load_state_dict(avg: WeightAverager, state: dict[str, Any], strict: bool = True) -> None:
    if not isinstance(state, dict) or "meta" not in state or "tensors" not in state:
        raise CheckpointError("not a shardavg state dict: it needs 'meta' and 'tensors'")
    meta = decode_description(state["meta"], "state dict")
    saved = check_compatible(avg, meta, "the state dict", strict)
    indices = [i for i in _loadable(avg, saved) if avg._infos[i].name in state["tensors"]]
    with torch.no_grad():
        for index in indices:
            if not _owns(avg, index):
                continue
            name = avg._infos[index].name
            local = _local_part(state["tensors"][name])
            target = avg._shadows[index].view(-1)
            if local.shape != target.shape:
                raise CheckpointError(
                    f"{name!r}: the state dict holds {tuple(local.shape)} elements here, this rank holds "
                    f"{tuple(target.shape)}; load through torch.distributed.checkpoint to reshard"
                )
            if local.data_ptr() != target.data_ptr():  # DCP loaded into the shadow itself otherwise
                target.copy_(local)
        _fill_replicas(avg, indices)
    restore_counters(avg, meta, saved)
