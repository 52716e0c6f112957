"""Replicated weights: a single process, DDP, or DeepSpeed ZeRO stages 0-2.

Every rank holds every tensor whole, so the local view is the tensor itself; rank 0 owns
the export.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModuleStrategy, TensorInfo, grouped_by_identity, tensor_info
from .fsdp1 import FSDP1
from .fsdp2 import FSDP2
from .zero3 import Zero3


class Replicated(ModuleStrategy):
    """Every tensor whole on every rank; the local view is the tensor itself.

    Args:
        model: A plain module, a DDP module or a DeepSpeed ZeRO-0/1/2 engine.
    """

    name = "replicated"

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether no sharded adapter (ZeRO-3, FSDP1, FSDP2) fits ``model``.

        Args:
            model: The model as the user passed it.

        Returns:
            Whether its tensors are held whole.
        """
        return not any(sharded.fits(model) for sharded in (Zero3, FSDP1, FSDP2))

    def _scan_params(self) -> list[TensorInfo]:
        groups = grouped_by_identity(self.module.named_parameters(remove_duplicate=False))
        self._params = [tensor for _, tensor in groups]
        return [tensor_info(names, tensor, "param") for names, tensor in groups]

    def _param_views(self) -> list[torch.Tensor]:
        return self._params
