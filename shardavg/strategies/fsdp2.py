"""FSDP2 (``fully_shard``): each parameter is a DTensor sharded on dim 0.

The local view is the DTensor's local shard (``_local_tensor``); with ``Shard(0)`` (and ``Replicate`` for HSDP)
it covers whole rows, i.e. one contiguous range of the flattened tensor, also when dim 0 does
not divide by the world size or the shard is empty. Parameters that are not DTensors (left
out of ``fully_shard``) are held whole.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import StrategyError
from .base import Strategy, TensorInfo, grouped_by_identity, whole_tensor_info


def _dtensor_info(names: list[str], param: DTensor) -> TensorInfo:
    for placement in param.placements:
        if not (isinstance(placement, Replicate) or (type(placement) is Shard and placement.dim == 0)):
            raise StrategyError(
                f"parameter {names[0]!r} has placements {param.placements}; shardavg supports "
                "Shard(0) and Replicate() (FSDP2 and HSDP), not tensor-parallel layouts"
            )
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    row = param.shape[1:].numel()
    start = offset[0] * row if param.dim() else 0
    return TensorInfo(
        name=names[0],
        aliases=tuple(names[1:]),
        kind="param",
        shape=param.shape,
        dtype=param.dtype,
        requires_grad=param.requires_grad,
        start=start,
        end=start + torch.Size(local_shape).numel(),
    )


class FSDP2(Strategy):
    name = "fsdp2"

    @staticmethod
    def fits(model: nn.Module) -> bool:
        return any(isinstance(p, DTensor) for p in model.parameters())

    def _scan_params(self) -> list[TensorInfo]:
        self.release_gathered()  # after a forward the root may still hold its unsharded parameters
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        return [
            _dtensor_info(names, tensor) if isinstance(tensor, DTensor) else whole_tensor_info(names, tensor, "param")
            for names, tensor in groups
        ]

    def _param_views(self) -> list[torch.Tensor]:
        # The local shard itself: to_local() makes a new alias at every call, which would look
        # like a new view each update. FSDP2 replaces it only when the storage really changes
        # (``model.to(...)`` swaps the parameter's contents).
        return [p._local_tensor if isinstance(p, DTensor) else p for p in self._params]

    def release_gathered(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
