"""DeepSpeed ZeRO-1/2 averaged from the optimizer's fp32 masters (``source="master"``).

ZeRO-1/2 keep every low-precision parameter whole on every rank, but partition the fp32
master copy: each rank's flat fp32 partition holds a flat range of the flattened
parameters, so a parameter's master may be split between ranks. DeepSpeed links each
parameter to its part on this rank (``param._hp_mapping``: ``hp_fragment``, DeepSpeed's view of
the flat partition, and where it starts in the flattened parameter), which is exactly this
strategy's answer: the local shard is that view, ``[start, end)`` its flat range, an empty range
where this rank holds none of it. Every rank's part follows from the parameter's offset in
its group's flat buffer and the partition size (a ``FlatLayout``; where this DeepSpeed does not
say the offsets, the parts are gathered). Frozen parameters have no master and are read whole.

``swapped()`` writes the whole live parameters, which every rank holds: the average is
gathered for it (``swap_gathers``), one bounded bucket at a time.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from ..layouts.parts import Part
from ..layouts.tensor_layout import FlatLayout
from .base import ModuleStrategy, TensorInfo, group_grid, grouped_by_identity, is_deepspeed_engine, tensor_info


class Zero12Master(ModuleStrategy):
    """The fp32 master parts of a DeepSpeed ZeRO-1/2 engine (``source="master"``).

    Args:
        model: The ``DeepSpeedEngine`` (stage 1 or 2) that ``deepspeed.initialize`` returned.
    """

    name = "zero12"
    swap_gathers = True

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether ``model`` is a DeepSpeed engine at ZeRO stage 1 or 2.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether it is such an engine.
        """
        return is_deepspeed_engine(model) and model.zero_optimization_stage() in (1, 2)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._flats = model.optimizer.single_partition_of_fp32_groups
        self._key: list | None = None

    def _placed(self) -> dict[int, tuple]:
        """Per trained parameter (by id): its group's grid of ranks, the partition size and its
        offset in the group's flat buffer, as DeepSpeed laid them out."""
        optimizer, placed = self.model.optimizer, {}
        for index, params in enumerate(optimizer.round_robin_bit16_groups):
            offsets = getattr(optimizer, "round_robin_bit16_offsets", None)
            starts = offsets[index] if offsets is not None else [0, *accumulate(p.numel() for p in params)]
            group = optimizer.real_dp_process_group[index]
            range_numel = optimizer.bit16_groups_flat[index].numel() // group_grid(group).shape[0]
            for param, start in zip(params, starts):
                placed[id(param)] = (group_grid(group), range_numel, int(start))
        return placed

    def _scan_params(self) -> list[TensorInfo]:
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        placed = self._placed()
        infos = []
        for names, param in groups:
            info = tensor_info(names, param, "param")
            if param.requires_grad:
                mapping = getattr(param, "_hp_mapping", None)
                start = 0 if mapping is None else mapping.lp_fragment_address.start
                end = start if mapping is None else start + mapping.lp_fragment_address.numel
                part = Part.flat(info.shape, start, end)
                grid, range_numel, offset = placed.get(id(param), (None, 0, 0))
                layout = None if grid is None else FlatLayout(tuple(info.shape), grid, 0, range_numel, offset)
                info = TensorInfo(info.name, info.aliases, "param", info.shape, torch.float32, True, part, layout)
            infos.append(info)
        return infos

    def _param_views(self) -> list[torch.Tensor]:
        key = [flat.data_ptr() for flat in self._flats]  # the masters stay put while these do
        if key != self._key:
            self._views = [self._master(param) for param in self._params]
            self._key = key
        return self._views

    @staticmethod
    def _master(param: torch.Tensor) -> torch.Tensor:
        if not param.requires_grad:
            return param.detach()
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # none of this parameter's master is on this rank
            return torch.empty(0, dtype=torch.float32, device=param.device)
        return mapping.hp_fragment.detach()

    def swap_views(self) -> list[torch.Tensor]:
        """The whole live parameters (the forward reads them), then the buffers.

        Returns:
            One tensor per info of the latest ``tensors()``.
        """
        return [param.detach() for param in self._params] + self.local_shards()[len(self._params) :]
