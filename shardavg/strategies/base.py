"""What every strategy adapter answers: which tensors there are, and where this rank's shard is.

An adapter lists each tensor of the plain (unwrapped) model once, as a ``TensorInfo``: its
canonical name and aliases, global shape and dtype, and the part ``[start, end)`` of the
flattened global tensor that this rank's *local view* covers. The local view is a tensor the
engine already owns (a DTensor's local shard, the real part of a ZeRO-3 partition, a slice of
an FSDP1 flat parameter, or the tensor itself) with exactly ``end - start`` elements.
Everything else (averaging, swapping, gathering, checkpoints) is built on these two answers.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

TensorKind = Literal["param", "buffer"]

# Infixes that wrappers insert into parameter names; the plain model has none of them.
_WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The name a parameter has in the plain model (no FSDP, checkpoint or compile infixes)."""
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the plain model and the part of it this rank holds."""

    name: str
    aliases: tuple[str, ...]  # other names of the same tensor (tied weights)
    kind: TensorKind
    shape: torch.Size  # global shape
    dtype: torch.dtype
    requires_grad: bool
    start: int  # this rank's local view covers [start, end) of the flattened global tensor
    end: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def is_deepspeed_engine(model: object) -> bool:
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def _is_compiled(model: object) -> bool:
    if "torch._dynamo" not in sys.modules:  # torch.compile was never called
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def unwrap(model: nn.Module) -> nn.Module:
    """Peel DDP, DeepSpeedEngine and torch.compile wrappers off the user's model."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel) or is_deepspeed_engine(model):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def grouped_by_identity(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[list[str], torch.Tensor]]:
    """Group names that refer to the same tensor object (tied weights), first name first."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), ([], tensor))[0].append(canonical_name(name))
    return list(groups.values())


def named_persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that ``module.state_dict()`` holds, under every name they have."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def whole_tensor_info(names: list[str], tensor: torch.Tensor, kind: TensorKind) -> TensorInfo:
    """Info for a tensor that this rank holds whole (replicated params, every buffer)."""
    return TensorInfo(
        name=names[0],
        aliases=tuple(names[1:]),
        kind=kind,
        shape=tensor.shape,
        dtype=tensor.dtype,
        requires_grad=kind == "param" and tensor.requires_grad,
        start=0,
        end=tensor.numel(),
    )


class Strategy(ABC):
    """Adapter between one training engine and the averager."""

    name: ClassVar[str]

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.module = unwrap(model)
        self._buffers: list[torch.Tensor] = []

    @staticmethod
    @abstractmethod
    def fits(model: nn.Module) -> bool:
        """Whether this adapter understands how ``model`` holds its parameters."""

    @abstractmethod
    def _scan_params(self) -> list[TensorInfo]:
        """List the parameters (once each) and remember how to reach their local views."""

    @abstractmethod
    def _param_views(self) -> list[torch.Tensor]:
        """The parameters' current local views, in ``_scan_params`` order. Called every update: keep it cheap."""

    def tensors(self) -> list[TensorInfo]:
        """Every parameter, then every persistent buffer (buffers are never sharded)."""
        infos = self._scan_params()
        buffer_groups = grouped_by_identity(named_persistent_buffers(self.module))
        self._buffers = [tensor for _, tensor in buffer_groups]
        infos += [whole_tensor_info(names, tensor, "buffer") for names, tensor in buffer_groups]
        return infos

    def local_views(self) -> list[torch.Tensor]:
        """Current local views aligned with ``tensors()``; the averager checks their identity each update."""
        return self._param_views() + self._buffers

    def release_gathered(self) -> None:
        """Drop full (unsharded) copies of parameters, so the next forward gathers the local shards.

        Called before weights are swapped in and after they are swapped back.
        """
