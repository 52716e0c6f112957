"""Shared pieces of the torchrun scenarios: the test model, one builder per engine, the engines'
own gathers (the independent reference), a collective counter and plain-torch reference averages.

Scenarios import this module from their own directory (torchrun puts it on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, HIDDEN = 11, 6, 10  # VOCAB rows: not divisible by 2 or 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(h))))


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.proj.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h)


class TiedNet(nn.Module):
    """Every awkward case at once: an odd dim 0, a one-element parameter, BatchNorm buffers,
    a frozen submodule and tied input/output embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.gain = nn.Parameter(torch.ones(1))
        self.frozen = Frozen()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        h = h + self.gain * self.block(h)
        return self.head(self.frozen(h))


def init_distributed(deepspeed: bool = False) -> None:
    """gloo on CPU with a short timeout, so a stuck collective fails instead of hanging."""
    timeout = datetime.timedelta(seconds=120)
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


SAME_DATA_ON_EVERY_RANK = False  # set by scenarios that need BatchNorm statistics equal on all ranks


def finish() -> None:
    """End a scenario that passed: tear the process group down and leave without the
    interpreter's teardown, where C++ threads of gloo and the profiler now and then abort
    (`terminate called without an active exception`) after every check has passed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: each rank sees its own data, as in data-parallel training."""
    generator = torch.Generator().manual_seed(1000 * step + (0 if SAME_DATA_ON_EVERY_RANK else dist.get_rank()))
    tokens = torch.randint(0, VOCAB, (size, 5), generator=generator)
    return tokens, torch.randint(0, VOCAB, (size,), generator=generator)


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------- engines


@dataclass
class Engine:
    """A wrapped model, how to train it one step, and how to gather its live weights (its own API)."""

    name: str
    model: nn.Module  # what the user hands to WeightAverager
    step: Callable[[int], None]
    gather_live: Callable[[], dict[str, torch.Tensor]]  # full live params and buffers, every rank
    local_param_numels: Callable[[], dict[str, int]]  # elements of each trainable param's local shard
    forward: Callable[[torch.Tensor], torch.Tensor]
    dtype: torch.dtype
    optimizer: torch.optim.Optimizer | None = None
    deepspeed_engine: object = None
    early_averager: object = None  # an averager built before the engine finished setting up


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    from shardavg.strategies.base import canonical_name

    return {canonical_name(n): b.detach().clone() for n, b in module.named_buffers()}


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, forward=None) -> None:
    tokens, targets = batch(step)
    loss = nn.functional.cross_entropy((forward or model)(tokens).float(), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.2, momentum=0.9)


def build_ddp(dtype: torch.dtype) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    plain = TiedNet().to(dtype)
    model = DDP(plain, broadcast_buffers=False)  # each rank keeps its own BatchNorm statistics
    optimizer = _optimizer(model.parameters())
    return Engine(
        name=f"ddp-{str(dtype)[6:]}",
        model=model,
        step=lambda step: _sgd_step(model, optimizer, step),
        gather_live=lambda: {n: p.detach().clone() for n, p in plain.named_parameters()} | _buffers(plain),
        local_param_numels=lambda: {n: p.numel() for n, p in plain.named_parameters() if p.requires_grad},
        forward=model,
        dtype=dtype,
        optimizer=optimizer,
    )


def build_fsdp2(dtype: torch.dtype) -> Engine:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TiedNet().to(dtype)
    fully_shard(model.block)
    fully_shard(model.frozen)
    fully_shard(model)
    return _fsdp2_engine(f"fsdp2-{str(dtype)[6:]}", model, dtype)


def _fsdp2_engine(name: str, model: nn.Module, dtype: torch.dtype) -> Engine:
    optimizer = _optimizer(model.parameters())

    def gather_live() -> dict[str, torch.Tensor]:
        model.reshard()  # after a forward the root keeps unsharded parameters registered
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()} | _buffers(model)

    return Engine(
        name=name,
        model=model,
        step=lambda step: _sgd_step(model, optimizer, step),
        gather_live=gather_live,
        local_param_numels=lambda: {n: p.to_local().numel() for n, p in model.named_parameters() if p.requires_grad},
        forward=model,
        dtype=dtype,
        optimizer=optimizer,
    )


def build_hsdp(dtype: torch.dtype) -> Engine:
    """FSDP2 on a 2-D mesh: replicated across the first dimension, sharded within the second."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TiedNet().to(dtype)
    for module in (model.block, model.frozen, model):
        fully_shard(module, mesh=mesh)
    engine = _fsdp2_engine(f"hsdp-{str(dtype)[6:]}", model, dtype)
    placements = {p.placements for p in model.parameters()}
    assert len(placements) == 1 and len(next(iter(placements))) == 2, f"not a 2-D layout: {placements}"
    return engine


def build_fsdp1(dtype: torch.dtype, use_orig_params: bool, mesh: bool = False, hybrid: bool = False) -> Engine:
    """FSDP1 over the default group, or (``mesh``) over a 1-D device mesh, whose sharded state
    dicts hold DTensors rather than ``ShardedTensor``s; with ``hybrid``, HYBRID_SHARD over a 2-D
    mesh (2 replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from shardavg.strategies.base import canonical_name

    torch.manual_seed(0)
    model = FSDP(
        TiedNet().to(dtype),
        auto_wrap_policy=ModuleWrapPolicy({Block, Frozen}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
        device_mesh=(
            init_device_mesh("cpu", (2, dist.get_world_size() // 2))
            if hybrid
            else init_device_mesh("cpu", (dist.get_world_size(),))
            if mesh
            else None
        ),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD,
    )
    optimizer = _optimizer(model.parameters())

    def gather_live() -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(model, writeback=False):
            params = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
        return params | _buffers(model)

    def local_param_numels() -> dict[str, int]:
        if use_orig_params:  # outside forward the original parameters are this rank's 1-D slices
            return {canonical_name(n): p.numel() for n, p in model.named_parameters() if p.requires_grad}
        return {  # one flat parameter per unit; its padding is not a parameter's
            canonical_name(n): p._local_shard.numel() - p._shard_numel_padded
            for n, p in model.named_parameters()
            if p.requires_grad
        }

    return Engine(
        name=f"fsdp1-{'hybrid-' if hybrid else ''}{'orig' if use_orig_params else 'flat'}-{str(dtype)[6:]}",
        model=model,
        step=lambda step: _sgd_step(model, optimizer, step),
        gather_live=gather_live,
        local_param_numels=local_param_numels,
        forward=model,
        dtype=dtype,
        optimizer=optimizer,
    )


@contextlib.contextmanager
def fp16_support(supported: bool) -> Iterator[None]:
    """Make DeepSpeed's CPU accelerator report oneDNN fp16 support as ``supported``, whatever this CPU has.

    ``zero.Init`` picks the partition dtype from it when given an explicit ``dtype``; forcing
    both answers proves a scenario does not depend on the machine it runs on.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    original = accelerator.is_fp16_supported
    accelerator.is_fp16_supported = lambda self: supported
    try:
        yield
    finally:
        accelerator.is_fp16_supported = original


def partition_dtypes(module: nn.Module) -> set[torch.dtype]:
    return {p.ds_tensor.dtype for p in module.parameters()}


def build_zero3(
    dtype: torch.dtype,
    persistence_threshold: int | None,
    via_zero_init: bool,
    init_dtype: torch.dtype | None = None,
    average_before_initialize: bool = False,
) -> Engine:
    """A ZeRO-3 engine; with ``via_zero_init`` the averager gets the bare module partitioned by zero.Init.

    ``zero.Init`` takes its dtype from the config (bf16 enabled or not), which means the same
    on every CPU. ``init_dtype`` passes an explicit dtype instead, the way users do: on CPUs
    without oneDNN fp16 DeepSpeed 0.19 then partitions in bf16 whatever was asked (a precedence
    slip in ``Init._set_dtype``); the engine's dtype is then what it really holds.
    ``average_before_initialize`` builds an EMA(0.9) averager on the zero.Init module before
    ``deepspeed.initialize`` re-allocates most partitions (``Engine.early_averager``).
    """
    import deepspeed

    zero: dict = {"stage": 3}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16 and init_dtype is None},
    }
    torch.manual_seed(0)
    if via_zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=init_dtype):
            module = TiedNet()
    else:
        module = TiedNet().to(dtype)  # buffers too: DeepSpeed's bf16 mode casts parameters only
    early_averager = None
    if average_before_initialize:
        from shardavg import EMA, WeightAverager

        early_averager = WeightAverager(module, EMA(decay=0.9))
    optimizer = _optimizer(module.parameters())
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    held = partition_dtypes(engine.module)
    if init_dtype is None:
        assert held == {dtype}, f"the ZeRO-3 engine holds {held}, the scenario means {dtype}"
    else:
        (dtype,) = held

    def step(index: int) -> None:
        tokens, targets = batch(index)
        loss = nn.functional.cross_entropy(engine(tokens).float(), targets)
        engine.backward(loss)
        engine.step()

    def gather_live() -> dict[str, torch.Tensor]:
        params = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            gathered = {n: p.detach().clone() for n, p in params.items()}
        return gathered | _buffers(engine.module)

    threshold = "default" if persistence_threshold is None else persistence_threshold
    init = "engine" if not via_zero_init else "init" if init_dtype is None else f"init-asked-{str(init_dtype)[6:]}"
    return Engine(
        name=f"zero3-{init}-persist{threshold}-{str(dtype)[6:]}",
        model=module if via_zero_init else engine,
        step=step,
        gather_live=gather_live,
        local_param_numels=lambda: {  # the partition without its padding
            n: max(0, min(p.ds_tensor.numel(), p.ds_numel - dist.get_rank() * p.ds_tensor.numel()))
            for n, p in engine.module.named_parameters()
            if p.requires_grad
        },
        forward=engine,
        dtype=dtype,
        deepspeed_engine=engine,
        early_averager=early_averager,
    )


# ----------------------------------------------------------------------------- checks


class CollectiveCount:
    """Counts the c10d collectives and point-to-point ops issued inside ``with counter:``."""

    def __enter__(self) -> CollectiveCount:
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(*exc)
        # The raw events, not profile.events(): that builds a Python object per op recorded, which
        # took a third of the averager scenario's time; the names are the same.
        events = self._profile.profiler.kineto_results.events()
        self.names = [e.name() for e in events if e.name().startswith(("c10d::", "gloo:"))]

    @property
    def count(self) -> int:
        return len(self.names)


@contextlib.contextmanager
def expect_raises(kind: type[BaseException], *fragments: str) -> Iterator[None]:
    """Like pytest.raises(match=...) for scenario scripts: the message must hold every fragment."""
    try:
        yield
    except kind as error:
        message = str(error)
        missing = [f for f in fragments if f not in message]
        assert not missing, f"{kind.__name__} message {message!r} lacks {missing}"
    else:
        raise AssertionError(f"expected {kind.__name__} mentioning {fragments}")


class PlainAverage:
    """The same rule in plain torch: a dict of fp32 tensors, lerped one by one."""

    def __init__(
        self,
        weight: Callable[[int], float],
        *,
        every_n_steps: int = 1,
        start_step: int = 0,
        average_buffers: bool = False,
        include_frozen: bool = False,
        copied: frozenset[str] = frozenset(),
    ) -> None:
        self.weight, self.every, self.start = weight, every_n_steps, start_step
        self.average_buffers, self.include_frozen = average_buffers, include_frozen
        self.copied = copied  # names copied at each update, never averaged (as include=/exclude= leave out)
        self.state: dict[str, torch.Tensor] = {}
        self.num_updates = 0

    def update(self, step: int, live: dict[str, torch.Tensor], frozen: set[str], buffers: set[str]) -> None:
        if step < self.start or (step - self.start) % self.every:
            return
        for name, value in live.items():
            averaged = (name not in buffers and (name not in frozen or self.include_frozen)) or (
                name in buffers and self.average_buffers and value.is_floating_point()
            )
            if self.num_updates == 0 or not averaged or name in self.copied:
                self.state[name] = value.clone()
            else:
                self.state[name].lerp_(value, self.weight(self.num_updates))
        self.num_updates += 1


def edm2_gamma(sigma_rel: float) -> float:
    """EDM2's own conversion (``std_to_exp``), written independently of shardavg."""
    import numpy as np

    tmp = sigma_rel**-2
    return float(np.roots([1, 7, 16 - tmp, 12 - tmp]).real.max())


def report(kind: str, payload: dict) -> None:
    """One machine-readable line the pytest driver collects, from rank 0 only."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    line = f"SHARDAVG_{kind} {json.dumps(payload, sort_keys=True)}\n"
    sys.stdout.write(line)  # (one write: lines of ranks that all report do not interleave)
    sys.stdout.flush()


def die_while_writing_shards(rank: int) -> None:
    """On ``rank``: the next shard file it writes gets its first tensor, then the process is SIGKILLed."""
    if dist.get_rank() != rank:
        return
    import signal

    import shardavg.averager.checkpoint

    real_write = shardavg.averager.checkpoint.write_safetensors

    def write_then_die(path, entries, tensors, metadata=None):
        def first_tensor_then_sigkill():
            yield next(iter(tensors))
            os.kill(os.getpid(), signal.SIGKILL)

        real_write(path, entries, first_tensor_then_sigkill(), metadata)

    shardavg.averager.checkpoint.write_safetensors = write_then_die


def check_derived_layout(averager, gathered: Callable[[str], bool] = lambda name: False) -> None:
    """Collective: the layout each rank derived (no gather) equals the one gathered from every
    rank as the library did before: every rank's part of every tensor, the owned chunks and the
    replicas; and only the tensors ``gathered`` names had to be gathered."""
    from shardavg.layouts.shard_layout import tiling

    layout, infos = averager.layout, averager._state.infos
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [info.part for info in infos])
    for index, info in enumerate(infos):
        parts = [theirs[index] for theirs in everyone]
        for holder, part in enumerate(parts):
            assert layout.part(index, holder) == part, f"{info.name}: rank {holder} holds {part}, derived otherwise"
        chunks = tiling(info, parts)
        assert layout.owned(index) == chunks, f"{info.name}: chunks {layout.owned(index)} != {chunks}"
        for owner, part in chunks:
            replicas = [r for r, held in enumerate(parts) if held == part and r != owner]
            assert layout.replicas(index, owner) == replicas, f"{info.name}: replicas of rank {owner}"
    derived_or_not = {infos[index].name for index in layout.gathered}
    expected = {info.name for info in infos if gathered(info.name)}
    assert derived_or_not == expected, f"gathered {sorted(derived_or_not)}, expected {sorted(expected)}"


def shared_folder() -> Path:
    """Collective: a new temporary folder, the same on every rank (all ranks share this machine)."""
    import tempfile

    made = [tempfile.mkdtemp(prefix="shardavg-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return Path(made[0])


def check_writers(averager, label: str, live: bool = False, average: str | None = None) -> None:
    """Collective: the export written by every rank (the default), by two and by rank 0 alone
    (``writers=1``, the single writer) holds the same files, byte for byte, whole and split in
    several files; so does the export by two named writers with a gather bucket a third of the
    largest tensor (``"pieces"``: large tensors gathered as pieces of rows, spread over the
    writers). By default (every rank) parameters laid out in ranges are written where they lie;
    named writers gather everything. Nothing temporary is left behind."""
    import shutil

    import export_ids

    world = dist.get_world_size()
    if world == 1:  # (one rank is the single writer: nothing to compare)
        return
    root = shared_folder()
    model_bytes = sum(info.numel * 4 for info in averager.tensors)
    bucket, piece = averager.gather_bucket_bytes, max(info.numel * 4 for info in averager.tensors) // 3
    variants = {"all": (None, bucket), "two": (2, bucket), "one": (1, bucket), "pieces": (2, piece)}
    if world == 2:
        del variants["two"]  # (the same as "pieces" with whole tensors)
    for size in ("5GB", max(1, model_bytes // 5)):
        folders = {}
        for variant, (writers, bucket_bytes) in variants.items():
            averager.gather_bucket_bytes = bucket_bytes
            folder = root / f"{variant}-{size}"
            folders[variant] = averager.export(folder, max_shard_size=size, writers=writers, live=live, average=average)
        averager.gather_bucket_bytes = bucket
        if dist.get_rank() == 0:
            for variant, folder in folders.items():  # (what made it differs: the number of writers)
                made = json.loads((folder / "provenance.json").read_text())
                assert made["writers"] == min(variants[variant][0] or world, world), made
            listed = {variant: export_ids.alike(folder) for variant, folder in folders.items()}  # (ids aside)
            names = {variant: sorted(files) for variant, files in listed.items()}
            assert all(named == names["one"] for named in names.values()), f"{label}: files differ: {names}"
            assert not [n for n in names["one"] if n.startswith(".")], f"{label}: left behind: {names['one']}"
            assert size == "5GB" or len(names["one"]) > 2, f"{label}: not split: {names['one']}"
            for name, single in listed["one"].items():
                for variant, files in listed.items():
                    assert files[name] == single, f"{label}: {name} written by {variant} differs"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
