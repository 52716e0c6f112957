"""Wrap a plain model with one of the engines the jobs in ``launch/`` run under, on CPU/gloo.

``wrap(kind, module, block, dtype)`` shards per ``block`` (the module class the engine wraps
or shards on its own) and returns a ``Wrapped``: what to hand to ``WeightAverager`` and to the
training step, the optimizer over the wrapped parameters, and the engine's own way to reach
the live weights (this rank's local shards).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Iterator
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
    optimizer: torch.optim.Optimizer
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


def hsdp_shape(replicas: int | None) -> tuple[int, int]:
    """(replicas, shards) of the HSDP mesh: by default one replica per node, sharded within it."""
    world = dist.get_world_size()
    if replicas is None:
        replicas = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if replicas < 1 or world % replicas:
        raise ValueError(f"hsdp: {world} processes cannot form {replicas} equal replicas")
    return replicas, world // replicas


def _mesh(kind: str, replicas: int | None):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "hsdp":
        return init_device_mesh("cpu", hsdp_shape(replicas), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),))


def no_training(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)


def wrap(
    kind: str,
    module: nn.Module,
    block: type[nn.Module],
    dtype: torch.dtype,
    deepspeed_config: dict | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = no_training,
    replicas: int | None = None,
) -> Wrapped:
    """Wrap ``module`` (cast to ``dtype`` here) with the engine ``kind``, and build ``optimizer``
    over the parameters the engine trains. ``replicas``: HSDP's replicate dimension."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINES}")
    if kind == "zero3":
        import deepspeed

        config = dict(deepspeed_config or {})
        config["bf16"] = {"enabled": dtype == torch.bfloat16}
        config.setdefault("train_micro_batch_size_per_gpu", 1)
        config.setdefault("zero_allow_untested_optimizer", True)
        engine, engine_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer(module.parameters()), config=config
        )
        return Wrapped(kind, engine, engine.module, engine_optimizer, deepspeed_engine=engine)
    module = module.to(dtype)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return Wrapped(kind, DistributedDataParallel(module), module, optimizer(module.parameters()))
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            module, auto_wrap_policy=ModuleWrapPolicy({block}), device_id=torch.device("cpu")
        )
        return Wrapped(kind, model, module, optimizer(model.parameters()))
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(kind, replicas)
    for child in module.modules():
        if isinstance(child, block):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return Wrapped(kind, module, module, optimizer(module.parameters()))
