"""DTensor parameters: FSDP2 (``fully_shard``), HSDP, tensor and expert parallel, and their mixes.

Each parameter that is a DTensor is read through its local shard, whatever its placements on
whatever mesh (``dtensor.py`` says which part of the global tensor that is: one box for
``Shard`` on any dims, uneven and empty shards included, several for ``_StridedShard``).
Parameters that are not DTensors (left out of ``fully_shard`` and of the parallel plan) are
held whole.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModuleStrategy, TensorInfo, grouped_by_identity, held_info
from .dtensor import is_dtensor, local_shards


class FSDP2(ModuleStrategy):
    """DTensor parameters, read through their local shards; other parameters held whole.

    Args:
        model: A model with DTensor parameters (``fully_shard``, tensor or expert parallel).
    """

    name = "fsdp2"

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether ``model`` has a DTensor parameter.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether any parameter is a DTensor.
        """
        return any(is_dtensor(p) for p in model.parameters())

    def _scan_params(self) -> list[TensorInfo]:
        self.release_gathered()  # after a forward the root may still hold its unsharded parameters
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        self._all_dtensors = all(map(is_dtensor, self._params))
        return [held_info(names, tensor, "param") for names, tensor in groups]

    def _param_views(self) -> list[torch.Tensor]:
        # The local shard itself: to_local() makes a new alias at every call, which would look
        # like a new view each update. FSDP2 replaces it only when the storage really changes
        # (``model.to(...)`` swaps the parameter's contents).
        return local_shards(self._params, self._all_dtensors)

    def release_gathered(self) -> None:
        """Reshard every ``fully_shard`` module (the root keeps its unsharded parameters after a forward)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
