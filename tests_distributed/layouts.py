"""The model and the builders of the multi-dimensional layouts: tensor parallel, FSDP2 + TP,
HSDP + TP, expert parallel and pipeline stages, plus FSDP2, ZeRO-3 and DDP of the same model,
so that one checkpoint can travel through all of them.

``LayerNet`` has what makes layouts awkward: dims that divide by neither 2 nor 4 (11-row
embedding and head), a 2-row layer that leaves ranks empty, a one-element parameter, a frozen
parameter, a buffer and a ``ModuleDict`` of layers that pipeline stages cut (torchtitan's way:
a deleted layer keeps every other name). Every builder returns a ``harness.Engine`` whose
``gather_live`` is the engine's own API (``full_tensor()``, ``GatheredParameters``, the stages'
tensors sent to every rank), the independent reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from harness import Engine
from torch import nn

VOCAB, DIM, HIDDEN, EXPERTS = 11, 6, 10, 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)  # column-wise under TP
        self.down = nn.Linear(HIDDEN, DIM)  # row-wise under TP
        self.tiny = nn.Linear(DIM, 2)  # column-wise, gathered: 2 rows, so some ranks hold none
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gain * (self.down(torch.relu(self.up(h))) + self.tiny(h).sum(-1, keepdim=True))


class MoE(nn.Module):
    """A tiny mixture of experts, dense routing: every token goes through every expert, weighted
    by the router's softmax. The experts' weights are one tensor per kind, expert first, as
    torchtitan's ``GroupedExperts``: what expert parallelism shards. ``expert_bias`` is moved
    after every step towards balanced loads outside autograd (as in DeepSeek-V3's auxiliary-free
    balancing), ``tokens_per_expert`` counts: buffers, averaged or copied like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(h) + self.expert_bias, dim=-1)  # [tokens, experts]
        with torch.no_grad():
            self.tokens_per_expert.add_(gates.sum(0))
        hidden = torch.relu(torch.einsum("td,edh->teh", h, self.w1))
        out = torch.einsum("teh,ehd->ted", hidden, self.w2)
        return h + (gates.unsqueeze(-1) * out).sum(1)

    @torch.no_grad()
    def balance(self) -> None:
        load = self.tokens_per_expert / self.tokens_per_expert.sum().clamp_min(1)
        self.expert_bias.add_(0.01 * (1 / EXPERTS - load))


class LayerNet(nn.Module):
    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(2)})
        self.moe = MoE() if moe else None
        self.norm = nn.LayerNorm(DIM)
        self.norm.bias.requires_grad_(False)  # a frozen parameter
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens to logits; a pipeline stage without the embedding takes the hidden states, one
        without the head returns them."""
        h = self.embed(tokens).mean(1) if self.embed is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        if self.moe is not None:
            h = self.moe(h)
        return self.head(self.norm(h) * self.scale) if self.head is not None else h


def plain(moe: bool = False) -> LayerNet:
    torch.manual_seed(0)
    return LayerNet(moe)


def full_names(moe: bool = False) -> set[str]:
    return set(plain(moe).state_dict())


# ----------------------------------------------------------------------------- data and steps


def batch(step: int, data_rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel rank ``data_rank`` (ranks of one tensor-parallel group share it)."""
    generator = torch.Generator().manual_seed(1000 * step + data_rank)
    tokens = torch.randint(0, VOCAB, (size, 5), generator=generator)
    return tokens, torch.randint(0, VOCAB, (size,), generator=generator)


def optimizer_for(params) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.2, momentum=0.9)


def _trainer(model: nn.Module, optimizer: torch.optim.Optimizer, data_rank: int) -> Callable[[int], None]:
    def step(index: int) -> None:
        tokens, targets = batch(index, data_rank)
        loss = nn.functional.cross_entropy(model(tokens).float(), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if getattr(model, "moe", None) is not None:
            model.moe.balance()

    return step


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` whole (``full_tensor()`` of DTensors: a collective)."""
    from torch.distributed.tensor import DTensor

    from shardavg.strategies.base import canonical_name

    for module in model.modules():
        if hasattr(module, "reshard"):
            module.reshard()
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        out[canonical_name(name)] = value.detach().clone()
    return out


def _local_numels(model: nn.Module) -> Callable[[], dict[str, int]]:
    from torch.distributed.tensor import DTensor

    return lambda: {
        n: (p.to_local() if isinstance(p, DTensor) else p).numel()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _engine(name: str, model: nn.Module, dtype: torch.dtype, data_rank: int) -> Engine:
    optimizer = optimizer_for(model.parameters())
    return Engine(
        name=name,
        model=model,
        step=_trainer(model, optimizer, data_rank),
        gather_live=lambda: _full(model),
        local_param_numels=_local_numels(model),
        forward=model,
        dtype=dtype,
        optimizer=optimizer,
    )


# ----------------------------------------------------------------------------- layouts


def tp_plan() -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan[f"layers.{i}.up"] = ColwiseParallel()
        plan[f"layers.{i}.down"] = RowwiseParallel()
        plan[f"layers.{i}.tiny"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def build_tp(dtype: torch.dtype, dp_shape: tuple[int, ...] = (), fsdp: bool = False) -> Engine:
    """Tensor parallel over the last mesh dim; with ``fsdp``, FSDP2 over the others: one dim
    (FSDP2 + TP) or two (HSDP + TP, replicate x shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    tp = world // max(1, int(torch.tensor(dp_shape).prod()) if dp_shape else 1)
    names = (
        ("replicate", "shard", "tp")[-len(dp_shape) - 1 :] if len(dp_shape) == 2 else ("dp", "tp")[-len(dp_shape) - 1 :]
    )
    mesh = init_device_mesh("cpu", (*dp_shape, tp), mesh_dim_names=names)
    model = plain().to(dtype)
    parallelize_module(model, mesh["tp"], tp_plan())
    if fsdp:
        dp = mesh[names[:-1]] if len(dp_shape) == 2 else mesh[names[0]]
        for layer in model.layers.values():
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    data_rank = dist.get_rank() // tp
    label = "tp" if not dp_shape else ("hsdp_tp" if len(dp_shape) == 2 else "fsdp2_tp")
    shape = "x".join(str(n) for n in (*dp_shape, tp))
    return _engine(f"{label}-{shape}-{str(dtype)[6:]}", model, dtype, data_rank)


def build_ep(dtype: torch.dtype) -> Engine:
    """Expert parallel: the experts' weights sharded over ``ep`` (expert dim), FSDP2 over ``dp``
    on dim 0 for ``w1`` (on top of EP's: a strided shard) and dim 1 for ``w2``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    ep = 2
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    model = plain(moe=True).to(dtype)
    moe = model.moe
    for name in ("w1", "w2"):
        value = getattr(moe, name)
        sharded = distribute_tensor(value.detach(), mesh["ep"], [Shard(0)])
        setattr(moe, name, nn.Parameter(sharded))
    moe.forward = _ep_forward(moe, mesh["ep"])
    placement = {moe.w2: Shard(1)}
    fully_shard(moe, mesh=mesh["dp"], shard_placement_fn=lambda p: placement.get(p, Shard(0)))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _engine(f"ep-{world // ep}x{ep}-{str(dtype)[6:]}", model, dtype, dist.get_rank() // ep)


def _ep_forward(moe: MoE, mesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MoE forward with the experts' weights as DTensors: the tokens (the same on the ranks of
    an expert group) replicated, each rank running its experts, the outputs summed over ``ep``."""
    from torch.distributed.tensor import DTensor, Replicate

    def forward(h: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(moe.router(h) + moe.expert_bias, dim=-1)
        with torch.no_grad():
            moe.tokens_per_expert.add_(gates.sum(0))
        x = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
        g = DTensor.from_local(gates, mesh, [Replicate()], run_check=False)
        hidden = torch.relu(torch.einsum("td,edh->teh", x, moe.w1))
        out = torch.einsum("teh,ehd->ted", hidden, moe.w2)
        mixed = (g.unsqueeze(-1) * out).sum(1)
        return h + mixed.redistribute(mesh, [Replicate()]).to_local()

    return forward


def build_fsdp2(dtype: torch.dtype) -> Engine:
    from torch.distributed.fsdp import fully_shard

    model = plain().to(dtype)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    return _engine(f"fsdp2-{dist.get_world_size()}-{str(dtype)[6:]}", model, dtype, dist.get_rank())


def build_ddp(dtype: torch.dtype) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = plain().to(dtype)
    model = DDP(module)
    engine = _engine(f"ddp-{dist.get_world_size()}-{str(dtype)[6:]}", model, dtype, dist.get_rank())
    engine.gather_live = lambda: _full(module)
    return engine


def build_zero3(dtype: torch.dtype) -> Engine:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    module = plain().to(dtype)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer_for(module.parameters()), config=config)
    data_rank = dist.get_rank()

    def step(index: int) -> None:
        tokens, targets = batch(index, data_rank)
        engine.backward(nn.functional.cross_entropy(engine(tokens).float(), targets))
        engine.step()

    def gather_live() -> dict[str, torch.Tensor]:
        params = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            gathered = {n: p.detach().clone() for n, p in params.items()}
        return gathered | {n: b.detach().clone() for n, b in engine.module.named_buffers()}

    return Engine(
        name=f"zero3-{dist.get_world_size()}-{str(dtype)[6:]}",
        model=engine,
        step=step,
        gather_live=gather_live,
        local_param_numels=lambda: {
            n: max(0, min(p.ds_tensor.numel(), p.ds_numel - dist.get_rank() * p.ds_tensor.numel()))
            for n, p in engine.module.named_parameters()
            if p.requires_grad
        },
        forward=engine,
        dtype=dtype,
        deepspeed_engine=engine,
    )


# ----------------------------------------------------------------------------- pipeline


STAGES = {0: {"embed", "layers.0"}, 1: {"layers.1", "norm", "head"}}  # what each stage keeps


def stage_module(full: LayerNet, stage: int) -> LayerNet:
    """A copy of the full model with the other stage's parts deleted (set to None or removed
    from the ``ModuleDict``): it keeps the full model's names. Both stages keep the root's
    ``scale`` buffer: a tensor two stages hold."""
    module = copy.deepcopy(full)
    keep = STAGES[stage]
    for name in ("embed", "norm", "head"):
        if name not in keep:
            setattr(module, name, None)
    for key in list(module.layers):
        if f"layers.{key}" not in keep:
            del module.layers[key]
    return module


class Pipelined:
    """Two pipeline stages (``ScheduleGPipe``, 2 micro-batches) over ``pp``, each stage FSDP2-sharded
    over ``dp`` when there is one. ``engine.model`` is this rank's stage module; ``group`` the
    pipeline's process group; ``gather_live`` every stage's tensors, whole, on every rank."""

    def __init__(self, dtype: torch.dtype) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        world = dist.get_world_size()
        dp = world // 2
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "pp"))
        self.stage_index = mesh["pp"].get_local_rank()
        self.group = mesh["pp"].get_group()
        self.dp_rank = mesh["dp"].get_local_rank()
        module = stage_module(plain().to(dtype), self.stage_index)
        if dp > 1:
            for layer in module.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
        self.module = module
        stage = PipelineStage(module, self.stage_index, 2, torch.device("cpu"), group=self.group)
        loss = lambda logits, targets: nn.functional.cross_entropy(logits.float(), targets)  # noqa: E731
        self.schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss)
        self.optimizer = optimizer_for(module.parameters())
        self.dtype = dtype

    def step(self, index: int) -> None:
        tokens, targets = batch(index, self.dp_rank)
        self.optimizer.zero_grad()
        if self.stage_index == 0:
            self.schedule.step(tokens)
        else:
            self.schedule.step(target=targets)
        self.optimizer.step()

    def gather_live(self) -> dict[str, torch.Tensor]:
        mine = _full(self.module)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {name: value for stage in everyone for name, value in stage.items()}

    def engine(self) -> Engine:
        return Engine(
            name=f"pp-2x{dist.get_world_size() // 2}-{str(self.dtype)[6:]}",
            model=self.module,
            step=self.step,
            gather_live=self.gather_live,
            local_param_numels=_local_numels(self.module),
            forward=self.module,
            dtype=self.dtype,
            optimizer=self.optimizer,
        )


def layouts(world: int) -> dict[str, Callable[[torch.dtype], Engine]]:
    """Every multi-dimensional layout this world size holds (tensor parallel of degree 2: the
    colwise/rowwise pair needs a hidden size that divides by it)."""
    found: dict[str, Callable[[torch.dtype], Engine]] = {}
    if world == 2:
        found["tp"] = build_tp
    if world == 4:
        found["fsdp2_tp"] = lambda d: build_tp(d, (2,), fsdp=True)
        found["hsdp_tp"] = lambda d: build_tp(d, (2, 1), fsdp=True)
        found["hsdp_tp_shard"] = lambda d: build_tp(d, (1, 2), fsdp=True)
    if world in (2, 4):
        found["ep"] = build_ep
    return found
