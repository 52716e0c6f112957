"""Wrap a plain model with one of the engines the jobs in ``launch/`` run under, on CPU/gloo.

``wrap(kind, module, block, dtype)`` shards per ``block`` (the module class the engine wraps
or shards on its own) and returns a ``Wrapped``: what to hand to ``WeightAverager`` and to the
training step, and the engine's own ways to reach the live weights (local shards, full tensors).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ENGINES = ("ddp", "fsdp1", "fsdp2", "hsdp", "zero3")


def init_distributed(kind: str) -> None:
    """The process group over gloo (DeepSpeed's own init for ZeRO-3), with a bounded timeout."""
    timeout = datetime.timedelta(seconds=300)
    if kind == "zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    elif not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)


@dataclass
class Wrapped:
    kind: str
    model: Any  # what WeightAverager and the forward take: DDP, FSDP module, fully_shard'ed module, DeepSpeedEngine
    module: nn.Module  # the plain module inside, with the plain names
    deepspeed_engine: Any = None

    def local_shards(self) -> Iterator[torch.Tensor]:
        """This rank's part of every parameter, as the engine holds it (what an optimizer updates)."""
        if self.kind == "zero3":
            yield from (p.ds_tensor for p in self.module.parameters())
        elif self.kind in ("fsdp2", "hsdp"):
            from torch.distributed.tensor import DTensor

            yield from (p._local_tensor if isinstance(p, DTensor) else p for p in self.module.parameters())
        else:  # DDP: whole parameters; FSDP1: the flat parameters' local shards
            yield from self.model.parameters()


def _mesh(kind: str):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if kind == "hsdp":
        if world % 2:
            raise ValueError(f"hsdp needs an even number of processes (2 x N/2 mesh), got {world}")
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def wrap(
    kind: str, module: nn.Module, block: type[nn.Module], dtype: torch.dtype, deepspeed_config: dict | None = None
) -> Wrapped:
    """Wrap ``module`` (already in ``dtype``'s precision or not: it is cast here) with the engine ``kind``."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINES}")
    if kind == "zero3":
        import deepspeed

        config = dict(deepspeed_config or {})
        config["bf16"] = {"enabled": dtype == torch.bfloat16}
        config.setdefault("train_micro_batch_size_per_gpu", 1)
        config.setdefault("zero_allow_untested_optimizer", True)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        return Wrapped(kind, engine, engine.module, deepspeed_engine=engine)
    module = module.to(dtype)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return Wrapped(kind, DistributedDataParallel(module), module)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            module, auto_wrap_policy=ModuleWrapPolicy({block}), device_id=torch.device("cpu")
        )
        return Wrapped(kind, model, module)
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(kind)
    for child in module.modules():
        if isinstance(child, block):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return Wrapped(kind, module, module)
