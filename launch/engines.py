"""Wrap a plain model with one of the engines the jobs in ``launch/`` run under: on CPU over gloo,
or on this rank's GPU over NCCL (``init_distributed(kind, "cuda")``, then ``wrap(..., device=...)``).

``wrap(kind, module, block, dtype, ...)`` shards per ``block`` (the module class the engine
wraps or shards on its own) and returns a ``Wrapped``: what to hand to ``WeightAverager`` (with
the options it needs: a pipeline's group), how to take one training step and evaluate a batch,
the optimizer over the wrapped parameters, and the engine's own way to reach the live weights
(this rank's local shards). Besides data parallel (DDP, FSDP1, FSDP2, HSDP, ZeRO-3):

- ``fsdp2_tp``: tensor parallel inside a block over ``parallel.tp`` ranks (attention and MLP
  column-wise in, row-wise out), FSDP2 over the rest; ranks of one tensor-parallel group read
  the same batch.
- ``pp``: ``parallel.pp`` pipeline stages cut from the full model by deleting the other stages'
  blocks (so every stage keeps the full model's names), ``ScheduleGPipe`` with
  ``parallel.microbatches``, FSDP2 within each stage over the rest. The embedding, tied to the
  output head, lives in the first and the last stage: its gradients are summed between them, so
  the two copies stay one tensor (the averager sees it held by both stages).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardavg.integrations import Verdict, deepspeed, norm_verdict

CPU = torch.device("cpu")
ENGINES = ("ddp", "fsdp1", "fsdp2", "hsdp", "zero3", "fsdp2_tp", "pp")


def init_distributed(kind: str, device_type: str = "cpu") -> torch.device:
    """The process group (DeepSpeed's own init for ZeRO-3), with a bounded timeout: gloo on CPU;
    on ``"cuda"`` NCCL for CUDA tensors and gloo for CPU ones, this rank on GPU ``LOCAL_RANK``.
    Returns the device the engines put the model on."""
    timeout = datetime.timedelta(seconds=300)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    elif device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        raise ValueError(f"device: expected cpu or cuda, not {device_type!r}")
    if kind == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    elif not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return device


@dataclass
class Wrapped:
    kind: str
    model: Any  # what WeightAverager and the forward take: DDP, FSDP module, fully_shard'ed module, engine, stage
    module: nn.Module  # the plain module inside, with the plain names (a pipeline stage: its part of them)
    optimizer: torch.optim.Optimizer
    deepspeed_engine: Any = None
    data_rank: int = 0  # which batch this rank reads, of ``data_world`` (ranks of one TP group share one)
    data_world: int = 1
    averager_options: dict = field(default_factory=dict)  # a pipeline's {"pipeline": group}
    counts_loss: bool = True  # whether this rank's loss is one of the data-parallel losses (not a TP copy)
    pipeline: Any = None  # the schedule, stage and groups under ``pp``

    def local_shards(self) -> Iterator[torch.Tensor]:
        """This rank's part of every parameter, as the engine holds it (what an optimizer updates)."""
        if self.kind == "zero3":
            yield from (p.ds_tensor for p in self.module.parameters())
        elif self.kind in ("fsdp2", "hsdp", "fsdp2_tp", "pp"):
            from torch.distributed.tensor import DTensor

            yield from (p._local_tensor if isinstance(p, DTensor) else p for p in self.module.parameters())
        else:  # DDP: whole parameters; FSDP1: the flat parameters' local shards
            yield from self.model.parameters()

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, lr: float, clip: float) -> tuple[float, Verdict]:
        """One optimizer step on this rank's batch: the loss (the data-parallel rank's own), and the
        verdict on the step for ``update(finite=...)``: the total gradient norm clipped with (every
        engine computes it anyway), or under ZeRO-3 the engine's own verdict."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.kind == "zero3":  # the engine clips (gradient_clipping) and steps
            loss = self.model(tokens, targets)
            self.deepspeed_engine.backward(loss)
            self.deepspeed_engine.step()
            return loss.item(), deepspeed.verdict(self.deepspeed_engine)
        if self.kind == "pp":
            loss = self.pipeline.step(tokens, targets)
        else:
            loss = self.model(tokens, targets)
            loss.backward()
        if self.kind == "fsdp1":
            norm = self.model.clip_grad_norm_(clip)
        elif self.kind in ("fsdp2_tp", "pp"):
            norm = clip_across_meshes(self.module, clip, self.pipeline)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), norm_verdict(norm)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The held-out loss of a batch on ranks that count it (``counts_loss``), 0 elsewhere."""
        loss = self.pipeline.eval(tokens, targets) if self.kind == "pp" else self.model(tokens, targets)
        return loss.double() if self.counts_loss else torch.zeros((), dtype=torch.float64)


def hsdp_shape(replicas: int | None) -> tuple[int, int]:
    """(replicas, shards) of the HSDP mesh: by default one replica per node, sharded within it."""
    world = dist.get_world_size()
    if replicas is None:
        replicas = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if replicas < 1 or world % replicas:
        raise ValueError(f"hsdp: {world} processes cannot form {replicas} equal replicas")
    return replicas, world // replicas


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
    parallel: dict | None = None,
    device: torch.device = CPU,
) -> Wrapped:
    """Wrap ``module`` (cast to ``dtype`` and moved to ``device`` here) with the engine ``kind``, and
    build ``optimizer`` over the parameters the engine trains. ``replicas``: HSDP's replicate
    dimension; ``parallel``: ``{tp, pp, microbatches}`` for ``fsdp2_tp`` and ``pp``."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINES}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "zero3":
        import deepspeed

        config = dict(deepspeed_config or {})
        config["bf16"] = {"enabled": dtype == torch.bfloat16}
        config.setdefault("train_micro_batch_size_per_gpu", 1)
        config.setdefault("zero_allow_untested_optimizer", True)
        engine, engine_optimizer, _, _ = deepspeed.initialize(
            model=module.to(device), optimizer=optimizer(module.parameters()), config=config
        )
        return Wrapped(kind, engine, engine.module, engine_optimizer, engine, rank, world)
    module = module.to(device, dtype)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return Wrapped(kind, DistributedDataParallel(module), module, optimizer(module.parameters()), None, rank, world)
    if kind == "fsdp1":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            module,
            auto_wrap_policy=ModuleWrapPolicy({block}),
            device_id=device,
            # (over a mesh: its sharded state dicts hold DTensors, which DCP's stagers copy)
            device_mesh=init_device_mesh(device.type, (world,)),
        )
        return Wrapped(kind, model, module, optimizer(model.parameters()), None, rank, world)
    if kind == "fsdp2_tp":
        return _tensor_parallel(module, block, optimizer, parallel["tp"], device)
    if kind == "pp":
        return _pipeline(module, optimizer, parallel["pp"], parallel["microbatches"], device)
    from torch.distributed.device_mesh import init_device_mesh

    shape = hsdp_shape(replicas) if kind == "hsdp" else (world,)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard") if kind == "hsdp" else None)
    _fully_shard(module, block, mesh)
    return Wrapped(kind, module, module, optimizer(module.parameters()), None, rank, world)


def _fully_shard(module: nn.Module, block: type[nn.Module], mesh) -> None:
    """FSDP2 per block, then the root (what every FSDP2 engine here does)."""
    from torch.distributed.fsdp import fully_shard

    for child in module.modules():
        if isinstance(child, block):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)


# ----------------------------------------------------------------------------- tensor parallel


def _tensor_parallel(
    module: nn.Module, block: type[nn.Module], optimizer: Callable, tp: int, device: torch.device
) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    for child in module.modules():
        if isinstance(child, block):
            parallelize_module(child, mesh["tp"], plan)
    _fully_shard(module, block, mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    counts = mesh["tp"].get_local_rank() == 0
    return Wrapped("fsdp2_tp", module, module, optimizer(module.parameters()), None, dp_rank, world // tp,
                   counts_loss=counts)  # fmt: skip


def clip_across_meshes(module: nn.Module, clip: float, pipeline: Pipeline | None) -> float:
    """``clip_grad_norm_`` for parameters on several meshes (tensor parallel's, FSDP2's) and over
    pipeline stages: each gradient's full norm (a DTensor's through its own reduction), summed over
    the stages, a tensor two stages hold counted once; every gradient scaled by the same factor."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in module.parameters() if p.grad is not None]
    tied = set() if pipeline is None or pipeline.first else {id(p.grad) for p in pipeline.tied}
    squares = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        norm = grad.norm(2)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if id(grad) not in tied:
            squares += norm.double() ** 2
    if pipeline is not None:
        dist.all_reduce(squares, group=pipeline.group)
    total = float(squares.sqrt())
    factor = clip / (total + 1e-6)
    if factor < 1:
        for grad in grads:
            grad.mul_(factor)
    return total


# ----------------------------------------------------------------------------- pipeline parallel


def stage_of(full: nn.Module, stage: int, stages: int) -> nn.Module:
    """The ``stage``-th of ``stages`` consecutive runs of blocks, as a copy of ``full`` with the
    others deleted: the full model's names stay. The first stage reads tokens (embedding and
    positions), the last makes logits (final norm and head); both keep the embedding, which the
    head shares."""
    import copy

    module = copy.deepcopy(full)
    keys = list(module.blocks)
    per = -(-len(keys) // stages)
    for key in keys[: stage * per] + keys[(stage + 1) * per :]:
        del module.blocks[key]
    module.first, module.last = stage == 0, stage == stages - 1
    if not module.first:
        module.position = None
    if not module.last:
        module.norm = None
    if not (module.first or module.last):
        module.embed = module.head = None
    return module


@dataclass
class Pipeline:
    schedule: Any
    group: Any  # this rank's pipeline (one rank per stage)
    tied_group: Any  # its first and last stage
    first: bool
    last: bool
    tied: list  # the parameters the first and the last stage both hold
    microbatches: int

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; the tied gradients summed between the first and
        the last stage; the mean loss, from the last stage to every stage of the pipeline."""
        losses: list = []
        if self.first:
            self.schedule.step(tokens, target=targets if self.last else None, losses=losses)
        else:
            self.schedule.step(target=targets if self.last else None, losses=losses)
        for param in self.tied:  # (a stage's FSDP2 shard of it: the same shard on the other end)
            grad = param.grad._local_tensor if hasattr(param.grad, "_local_tensor") else param.grad
            dist.all_reduce(grad, group=self.tied_group)
        return self._shared_loss(losses)

    @torch.no_grad()
    def eval(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list = []
        if self.first:
            self.schedule.eval(tokens, target=targets if self.last else None, losses=losses)
        else:
            self.schedule.eval(target=targets if self.last else None, losses=losses)
        return self._shared_loss(losses)

    def _shared_loss(self, losses: list) -> torch.Tensor:
        loss = torch.stack([part.detach().float() for part in losses]).mean() if self.last else torch.zeros(())
        dist.all_reduce(loss, group=self.group)  # (the last stage's, on every stage)
        return loss


def _pipeline(full: nn.Module, optimizer: Callable, stages: int, microbatches: int, device: torch.device) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from launch.model import Block, loss

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // stages, stages), mesh_dim_names=("dp", "pp"))
    stage = mesh["pp"].get_local_rank()
    module = stage_of(full, stage, stages)
    if world // stages > 1:
        _fully_shard(module, Block, mesh["dp"])
    group = mesh["pp"].get_group()
    runner = PipelineStage(module, stage, stages, device, group=group)
    schedule = ScheduleGPipe(runner, n_microbatches=microbatches, loss_fn=loss)
    tied_group = None  # the first and the last stage of this pipeline (rank = dp index * stages + stage)
    for dp_index in range(world // stages):
        ends = [dp_index * stages, dp_index * stages + stages - 1]
        made = dist.new_group(ends)  # (every rank creates every group, in the same order)
        tied_group = made if dist.get_rank() in ends else tied_group
    tied = [module.embed.weight] if module.first or module.last else []
    pipeline = Pipeline(schedule, group, tied_group, module.first, module.last, tied, microbatches)
    return Wrapped(
        "pp", module, module, optimizer(module.parameters()), None, mesh["dp"].get_local_rank(), world // stages,
        averager_options={"pipeline": group}, counts_loss=module.last, pipeline=pipeline,
    )  # fmt: skip
