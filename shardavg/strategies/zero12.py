"""DeepSpeed ZeRO-1/2 averaged from the optimizer's fp32 masters (``source="master"``).

ZeRO-1/2 keep every low-precision parameter whole on every rank, but partition the fp32
master copy: each rank's flat fp32 partition holds a contiguous run of the flattened
parameters, so a parameter's master may be split between ranks. DeepSpeed links each
parameter to its piece on this rank (``param._hp_mapping``: ``hp_fragment``, a view of the
flat partition, and where it starts in the flattened parameter), which is exactly this
adapter's answer: the local view is the fragment, ``[start, end)`` its place, an empty range
where this rank holds none of it. Frozen parameters have no master and are read whole.

``swapped()`` writes the whole live parameters, which every rank holds: the average is
gathered for it (``swap_gathers``), one bounded bucket at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parts import Part
from .base import ModuleStrategy, TensorInfo, grouped_by_identity, is_deepspeed_engine, tensor_info


class Zero12Master(ModuleStrategy):
    name = "zero12"
    swap_gathers = True

    @staticmethod
    def fits(model: nn.Module) -> bool:
        return is_deepspeed_engine(model) and model.zero_optimization_stage() in (1, 2)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._flats = model.optimizer.single_partition_of_fp32_groups
        self._key: list | None = None

    def _scan_params(self) -> list[TensorInfo]:
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        infos = []
        for names, param in groups:
            info = tensor_info(names, param, "param")
            if param.requires_grad:
                mapping = getattr(param, "_hp_mapping", None)
                start = 0 if mapping is None else mapping.lp_fragment_address.start
                end = start if mapping is None else start + mapping.lp_fragment_address.numel
                part = Part.flat(info.shape, start, end)
                info = TensorInfo(info.name, info.aliases, "param", info.shape, torch.float32, True, part)
            infos.append(info)
        return infos

    def _param_views(self) -> list[torch.Tensor]:
        key = [flat.data_ptr() for flat in self._flats]  # the fragments stay put while these do
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
        return [param.detach() for param in self._params] + self.local_views()[len(self._params) :]
