"""DeepSpeed ZeRO-3: each parameter's ``ds_tensor`` holds this rank's partition.

ZeRO-3 flattens a parameter, pads it to a multiple of the partition count and gives rank
``r`` elements ``[r * p, (r + 1) * p)`` of it (``p`` = the partition size). The local view is
the real (unpadded) head of ``ds_tensor``: the padding is uninitialised memory. Works for a
``DeepSpeedEngine`` and for a module partitioned by ``deepspeed.zero.Init``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import StrategyError
from .base import Strategy, TensorInfo, grouped_by_identity, is_deepspeed_engine, unwrap


def _partition_info(names: list[str], param: torch.Tensor) -> TensorInfo:
    if getattr(param, "ds_tensor", None) is None:
        raise StrategyError(f"parameter {names[0]!r} is not partitioned by ZeRO-3 (it has no ds_tensor)")
    if getattr(param, "ds_secondary_tensor", None) is not None:
        raise StrategyError(
            f"parameter {names[0]!r} has a ZeRO++ secondary partition (hpZ), which shardavg does not support"
        )
    location = getattr(param.ds_tensor, "final_location", None)
    if location is not None and "nvme" in str(location).lower():
        raise StrategyError(f"parameter {names[0]!r} is offloaded to NVMe, which shardavg does not support")
    partition = param.ds_tensor.numel()
    start = min(dist.get_rank(group=param.ds_process_group) * partition, param.ds_numel)
    return TensorInfo(
        name=names[0],
        aliases=tuple(names[1:]),
        kind="param",
        shape=torch.Size(param.ds_shape),
        dtype=param.ds_tensor.dtype,
        requires_grad=param.requires_grad,
        start=start,
        end=min(start + partition, param.ds_numel),
    )


class Zero3(Strategy):
    name = "zero3"
    _views_key: list | None = None  # what the cached views were sliced from

    @staticmethod
    def fits(model: nn.Module) -> bool:
        if is_deepspeed_engine(model):
            return model.zero_optimization_stage() == 3
        return any(hasattr(p, "ds_id") for p in unwrap(model).parameters())

    def _scan_params(self) -> list[TensorInfo]:
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        infos = [_partition_info(names, tensor) for names, tensor in groups]
        self._lengths = [info.end - info.start for info in infos]
        return infos

    def _param_views(self) -> list[torch.Tensor]:
        key = [(p.ds_tensor.data_ptr(), n) for p, n in zip(self._params, self._lengths)]
        if key != self._views_key:  # new parameters, or DeepSpeed re-allocated partitions (building its optimizer)
            self._views = [p.ds_tensor.detach().narrow(0, 0, n) for p, n in zip(self._params, self._lengths)]
            self._views_key = key
        return self._views

    def release_gathered(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        available = [p for p in self._params if p.ds_status == ZeroParamStatus.AVAILABLE]
        if available:  # e.g. persistent small parameters, kept whole after each step
            available[0].partition(param_list=available)
