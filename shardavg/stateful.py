"""The averager as a ``torch.distributed.checkpoint`` Stateful: ``dcp.save({..., "ema": avg})``.

Every tensor is offered as the *flattened* global tensor, of which this rank holds the chunk
it owns (a DTensor over ``LocalShardsWrapper``, the wrapper torchrec uses for arbitrary
shards), so ``dcp.load`` reshards it to any world size or strategy, the same way as
``avg.save``. The description (counters, rule, names, shapes) travels as a JSON string.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import Slot, check_compatible, loadable
from .description import check_description, with_checksum
from .errors import CheckpointError
from .layout import distributed, rank
from .state import AverageState


def encode_description(meta: dict[str, Any]) -> str:
    """The description as a JSON string: DCP stores a plain ``str`` through ``torch.save``, which
    shardavg's offline reader loads back with ``weights_only=True`` (no Python objects)."""
    return json.dumps(with_checksum(meta))


def decode_description(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: 'meta' is {type(value).__name__}, not a shardavg description")
    try:
        meta = json.loads(value)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{where}: 'meta' is not valid JSON: {error}") from error
    return check_description(meta, where)


def _owns(state: AverageState, index: int) -> bool:
    return any(owner == rank() for owner, _, _ in state.layout.chunks[index])


def _dcp_value(state: AverageState, index: int, average: str | None, meshes: dict[str, Any]) -> torch.Tensor:
    """Tensor ``index`` of ``average`` as DCP sees it: the flattened global tensor, of which this
    rank offers the chunk it owns. Replicas offer nothing (DCP would keep an arbitrary replica's
    copy of, say, a BatchNorm buffer); ``load_state_dict`` sends them the owner's chunk."""
    info = state.infos[index]
    piece, offset = state.piece(index, average), info.start
    if not _owns(state, index):  # an empty chunk at the end can never be mistaken for another rank's
        piece, offset = piece[:0], info.numel
    elif not state.stored(index):
        piece = piece.clone()  # a live value: loading must not write into the model
    if not distributed():
        return piece
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if piece.device.type not in meshes:  # one mesh over all ranks per device type
        meshes[piece.device.type] = DeviceMesh.from_group(dist.group.WORLD, piece.device.type)
    mesh = meshes[piece.device.type]
    shards = LocalShardsWrapper([piece], [(offset,)])
    return DTensor.from_local(shards, mesh, [Shard(0)], run_check=False, shape=torch.Size([info.numel]), stride=(1,))


def _fill_replicas(state: AverageState, slots: list[Slot]) -> None:
    """Collective: every rank holding a copy of a chunk it does not own receives the owner's."""
    if not distributed():
        return
    me = rank()
    for slot in slots:
        ranges = state.layout.ranges[slot.index]
        for owner, start, end in state.layout.chunks[slot.index]:
            holders = [r for r, held in enumerate(ranges) if held == (start, end) and r != owner]
            if not holders:
                continue
            shadow = state.piece(slot.index, slot.average)
            if me == owner or me in holders:
                dist.broadcast(shadow, src=owner)
            else:  # takes part without a copy of its own
                dist.broadcast(shadow.new_empty(end - start), src=owner)


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


def _local_part(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value._local_tensor
    if hasattr(value, "local_shards"):  # LocalShardsWrapper
        (value,) = value.local_shards()
    return value


def load_state_dict(state: AverageState, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Check the whole state dict (description, names, shapes, dtypes) first, then restore."""
    if not isinstance(state_dict, dict) or "meta" not in state_dict or not isinstance(state_dict.get("tensors"), dict):
        raise CheckpointError("not a shardavg state dict: it needs 'meta' and a 'tensors' dict")
    meta = decode_description(state_dict["meta"], "state dict")
    slots = loadable(state, check_compatible(state, meta, "the state dict", strict), meta)
    tensors = state_dict["tensors"]
    absent = sorted(slot.key for slot in slots if slot.key not in tensors)
    if absent:
        message = f"the state dict describes {absent} but its 'tensors' lack them"
        if strict:
            raise CheckpointError(f"{message}; pass strict=False to average them from the live weights on")
        warnings.warn(f"{message}: averaged from the live weights on", stacklevel=3)
    slots = [slot for slot in slots if slot.key in tensors]
    values = {}
    for slot in slots:
        if not _owns(state, slot.index):
            continue
        name, target = slot.key, state.piece(slot.index, slot.average)
        local = _local_part(tensors[name])
        if not isinstance(local, torch.Tensor) or local.shape != target.shape or local.dtype != target.dtype:
            found = f"{local.dtype} {tuple(local.shape)}" if isinstance(local, torch.Tensor) else type(local).__name__
            raise CheckpointError(
                f"{name!r}: the state dict holds {found} here, this rank holds {target.dtype} {tuple(target.shape)}; "
                "load through torch.distributed.checkpoint to reshard"
            )
        values[slot] = local
    with torch.no_grad():
        for slot, local in values.items():
            target = state.piece(slot.index, slot.average)
            if local.data_ptr() != target.data_ptr():  # DCP loaded into the shadow itself otherwise
                target.copy_(local)
        _fill_replicas(state, slots)
    state.restore(meta, {slot.key for slot in slots})
