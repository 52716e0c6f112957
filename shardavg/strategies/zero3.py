"""DeepSpeed ZeRO-3: each parameter's ``ds_tensor`` holds this rank's partition.

ZeRO-3 flattens a parameter, pads it to a multiple of the partition count and gives rank
``r`` elements ``[r * p, (r + 1) * p)`` of it (``p`` = the partition size): a ``FlatLayout`` over
the parameter's process group. The local shard is the real (unpadded) head of ``ds_tensor``:
the padding is uninitialised memory. Works for a
``DeepSpeedEngine`` and for a module partitioned by ``deepspeed.zero.Init``.

Offload to the CPU changes where the partitions live, not what they are: with
``offload_param.device = "cpu"`` each ``ds_tensor`` is a slice of a flat CPU buffer that the
optimizer writes after each step; with ``offload_optimizer.device = "cpu"`` the fp32 masters are
CPU tensors the optimizer steps in place. Both are averaged exactly, from either source. NVMe
offload is refused: NVMe partitions (``offload_param``) or masters (``offload_optimizer``, read by
``source="master"``) are in memory only while DeepSpeed uses them, so there is nothing there for
a shard-local, in-place update to read.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch import nn

from ..base.errors import StrategyError
from ..layouts.parts import Part
from ..layouts.tensor_layout import FlatLayout
from .base import ModuleStrategy, TensorInfo, group_grid, grouped_by_identity, is_deepspeed_engine, unwrap

_DS_TENSOR = operator.attrgetter("ds_tensor")
_NVME = "nvme"  # DeepSpeed's OffloadDeviceEnum.nvme, a str enum: equal to its value
_NVME_PARAMS = (
    "keeps ZeRO-3 parameter partitions on NVMe and reads each into memory only while DeepSpeed uses it, so this "
    "rank's partition is not there for update() to average in place (nor for swapped() to write). Offload the "
    'parameters to the CPU instead ("offload_param": {"device": "cpu"}, or zero.Init(remote_device="cpu")), '
    "which shardavg averages exactly, or keep them on the accelerator"
)


def _refuse_nvme(engine: nn.Module, master: bool) -> None:
    """Refuse what an engine's config puts on NVMe, before any partition is read.

    Read from the config, not from each partition: with ``offload_param`` on NVMe DeepSpeed keeps
    the partitions that fit in ``max_in_cpu`` in CPU memory and the rest on NVMe, so some
    parameters would look averageable and others not.

    Args:
        engine: A ZeRO-3 ``DeepSpeedEngine``.
        master: Whether the fp32 masters are to be read (``source="master"``).

    Raises:
        StrategyError: ``offload_param`` on NVMe; ``offload_optimizer`` on NVMe with ``master``.
    """
    if getattr(engine.zero_offload_param(), "device", None) == _NVME:
        raise StrategyError(
            f'DeepSpeed\'s "zero_optimization": {{"offload_param": {{"device": "nvme"}}}} {_NVME_PARAMS}'
        )
    if master and getattr(engine.zero_offload_optimizer(), "device", None) == _NVME:
        raise StrategyError(
            'source=\'master\' reads the fp32 masters, which DeepSpeed\'s "zero_optimization": {"offload_optimizer": '
            '{"device": "nvme"}} keeps on NVMe except while the optimizer steps: there is nothing in memory to '
            "average. Use source='live' (the default: it averages the parameter partitions, which stay in "
            'memory), or offload the optimizer to the CPU ("offload_optimizer": {"device": "cpu"}), whose masters '
            "are averaged exactly"
        )


def _partition_info(names: list[str], param: torch.Tensor, master: bool) -> TensorInfo:
    if getattr(param, "ds_tensor", None) is None:
        raise StrategyError(f"parameter {names[0]!r} is not partitioned by ZeRO-3 (it has no ds_tensor)")
    if getattr(param, "ds_secondary_tensor", None) is not None:
        raise StrategyError(
            f"parameter {names[0]!r} has a ZeRO++ secondary partition (hpZ), which shardavg does not support"
        )
    # (DeepSpeed marks partitions moved into CPU memory for offload_param "not-nvme": on the CPU, averaged)
    if getattr(param.ds_tensor, "final_location", None) == _NVME:  # e.g. zero.Init(remote_device="nvme")
        raise StrategyError(f"parameter {names[0]!r} is on NVMe: offload to NVMe {_NVME_PARAMS}")
    partition = param.ds_tensor.numel()
    start = min(dist.get_rank(group=param.ds_process_group) * partition, param.ds_numel)
    grid = group_grid(param.ds_process_group)
    return TensorInfo(
        name=names[0],
        aliases=tuple(names[1:]),
        kind="param",
        shape=torch.Size(param.ds_shape),
        dtype=torch.float32 if master and param.requires_grad else param.ds_tensor.dtype,
        requires_grad=param.requires_grad,
        part=Part.flat(param.ds_shape, start, min(start + partition, param.ds_numel)),
        layout=FlatLayout(tuple(param.ds_shape), grid, 0, partition, 0),
    )


class Zero3(ModuleStrategy):
    """DeepSpeed ZeRO-3: each parameter's local shard is the real head of its ``ds_tensor`` partition.

    Args:
        model: A ZeRO-3 ``DeepSpeedEngine``, or a module partitioned by ``deepspeed.zero.Init``.
        master: Read trained parameters from the optimizer's fp32 master partitions
            (where ``safe_get_local_fp32_param`` reads them), so a bf16/fp16 run is averaged
            before rounding; ``swapped()`` still writes the live partitions, which the forward
            reads. Frozen parameters have no master and are read live. Default False.

    Raises:
        StrategyError: ``master=True`` without a ZeRO-3 engine whose optimizer is built; an
            engine whose ``offload_param`` (or, with ``master=True``, ``offload_optimizer``) is
            on NVMe; a parameter partition on NVMe.
    """

    name = "zero3"
    _views_key: list | None = None  # what the cached views were sliced from
    _master_key: list | None = None

    def __init__(self, model: nn.Module, master: bool = False) -> None:
        super().__init__(model)
        self.master = master
        if master:
            optimizer = getattr(model, "optimizer", None) if is_deepspeed_engine(model) else None
            if getattr(optimizer, "fp32_partitioned_groups_flat", None) is None:
                raise StrategyError(
                    "source='master' needs the DeepSpeedEngine of a ZeRO-3 run with its optimizer built (pass "
                    "the engine deepspeed.initialize returned); its fp32 master partitions are what is averaged"
                )
            self._optimizer, self._flats = optimizer, optimizer.fp32_partitioned_groups_flat
        if is_deepspeed_engine(model):
            _refuse_nvme(model, master)

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether ``model`` is a ZeRO-3 engine or has parameters partitioned by ZeRO-3.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether it is held the ZeRO-3 way.
        """
        if is_deepspeed_engine(model):
            return model.zero_optimization_stage() == 3
        return any(hasattr(p, "ds_id") for p in unwrap(model).parameters())

    def _scan_params(self) -> list[TensorInfo]:
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        infos = [_partition_info(names, tensor, self.master) for names, tensor in groups]
        self._lengths = [info.local_numel for info in infos]
        return infos

    def _param_views(self) -> list[torch.Tensor]:
        if not self.master:
            return self._live_views()
        key = [flat.data_ptr() for flat in self._flats]  # the masters stay put while these do
        if key != self._master_key:
            self._masters = [
                self._master_partition(p, n) if p.requires_grad else live
                for p, n, live in zip(self._params, self._lengths, self._live_views())
            ]
            self._master_key = key
        return self._masters

    def _master_partition(self, param: torch.Tensor, length: int) -> torch.Tensor:
        """The real head of ``param``'s fp32 master partition: a view of the flat masters the
        optimizer steps in place, wherever they live.

        What ``safe_get_local_fp32_param`` reads, without its move to the accelerator: with
        ``offload_optimizer`` on the CPU of a GPU run that move is a copy, which the next step
        would leave stale.
        """
        group, offset, _ = self._optimizer.grad_position[self._optimizer.get_param_id(param)]
        return self._flats[group].detach().narrow(0, offset, length)

    def swap_views(self) -> list[torch.Tensor]:
        """The live partitions (the forward reads them, also with ``master=True``), then the buffers.

        Returns:
            One tensor per info of the latest ``tensors()``.
        """
        return self._live_views() + self.local_shards()[len(self._params) :]

    def _live_views(self) -> list[torch.Tensor]:
        key = [*map(torch.Tensor.data_ptr, map(_DS_TENSOR, self._params)), *self._lengths]  # (at C speed)
        if key != self._views_key:  # new parameters, or DeepSpeed re-allocated partitions (building its optimizer)
            self._views = [p.ds_tensor.detach().narrow(0, 0, n) for p, n in zip(self._params, self._lengths)]
            self._views_key = key
        return self._views

    def release_gathered(self) -> None:
        """Partition again the parameters ZeRO-3 keeps gathered (e.g. persistent small ones)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        available = [p for p in self._params if p.ds_status == ZeroParamStatus.AVAILABLE]
        if available:  # e.g. persistent small parameters, kept whole after each step
            available[0].partition(param_list=available)
