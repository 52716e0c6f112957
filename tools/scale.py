"""What building, updating, saving and loading a ``WeightAverager`` costs one rank of a W-rank job.

A sweep simulates one rank of a job of W ranks in one process with PyTorch's fake process group
(collectives return without data: an all-gather leaves every slot holding this rank's value),
in a fresh subprocess per (model, engine, W, rank), one at a time, so that no memory carries over::

    python -m tools.scale --json scale.jsonl --plot scale.png      # 2 models x 4 engines x W in 8..4096
    python -m tools.scale --json scale.jsonl --plot scale.png --resume   # after an interruption
    python -m tools.scale --models dense --engines fsdp2 --worlds 8 4096 --scale-down auto

and the same measurement under real ``torchrun`` with gloo, to check the simulation against::

    torchrun --nproc_per_node 2 -m tools.scale --real --models dense --json real.jsonl
    torchrun --nproc_per_node 4 -m tools.scale --real --models dense --json real.jsonl
    python -m tools.scale --models dense --worlds 2 4 --scale-down 64 --json real.jsonl  # simulated, beside

Models (Hugging Face names and shapes, built on the meta device, sharded, then materialised):
``dense`` is Llama-3-70B (80 layers x 9 tensors + 3: 723 tensors), ``moe`` DeepSeek-V3 with unfused
experts (61 layers, 58 of them with 256 experts of 3 tensors: 45,395 tensors). ``--scale-down K``
divides every hidden size by K and keeps the tensor count and the distinct shapes: the costs
measured go per tensor and per rank more than per byte. The default K is one per model
(``SCALE_DOWN``), the same at every W and engine so that their curves compare; ``--scale-down auto``
takes per run the smallest power of two within ``--budget-mib`` of this rank's shards under FSDP2
and HSDP x TP (the dense model at its real shapes from W = 512 on), of the whole model under FSDP1
and ZeRO-3, which materialise each tensor whole on every rank while sharding.

Engines: ``fsdp2`` (``fully_shard`` per layer, then the root, on a 1-D mesh of W); ``hsdp_tp`` (a
(replicate, shard, tp) mesh, tp = min(8, W/2), up to ``--hsdp-shard`` ranks sharding: the
projections column- and row-wise tensor parallel with ``parallelize_module``, every expert's too,
then ``fully_shard`` on the (replicate, shard) submesh); ``fsdp1`` (``FullyShardedDataParallel`` per
layer, ``device_id=cpu``, meta-device init through ``param_init_fn``); ``zero3`` (DeepSpeed
``zero.Init`` partitioning with ``DS_ACCELERATOR=cpu``: the partitioned module, without
``deepspeed.initialize``, which takes minutes for 45,000 tensors; its local shards are bf16 on CPUs
without oneDNN fp16, DESIGN.md says why). FSDP2 makes all W chunks of every parameter to keep one,
O(W) per tensor: ``LazyChunks`` makes only those it reads (``--torch-chunks``: torch's own).

Each run measures the model (build time, RSS growth, bytes of local shards), then the averager:
construction time, ``update()`` (median of 5), ``save`` (under the fake group each rank writes its
own shard, so rank 0 and rank W-1 save apart), ``load`` of that save, the manifest's size, DCP's
``state_dict()``, the process's peak RSS by then, the peak of Python memory traced during
construction (built again under tracemalloc), and last ``dcp.save``. The table shows the slower of
rank 0 and rank W-1, and each one's own save; a failing stage shows as ``fails: ...`` in its column
(and in the JSON line's ``errors``) and the rest goes on; a run past ``--timeout`` or
``--max-rss-gib`` is killed and keeps what it had measured. Under the fake group ``dcp.save``
cannot run (see ``FAKE_DCP_SAVE_LIMIT``). Under ``--real`` the engines run one after another in the
same processes: the RSS columns of the later ones include memory the earlier ones freed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("scale")

MODELS = ("dense", "moe")
ENGINES = ("fsdp2", "hsdp_tp", "fsdp1", "zero3")
WORLDS = (8, 64, 512, 4096)
UPDATE_REPEATS = 5
# The hidden-size divisor K by default: one per model, the same at every W and engine, so that their
# curves compare (shardavg's construction walks every dim's indices: its cost depends on K too)
SCALE_DOWN = {"dense": 16, "moe": 64}
REAL_SCALE_DOWN = 64  # --real: a small model
# dcp.save fails under the fake group at every W (rank 0 checks a global plan made of W copies of its
# own local plan, the others unpickle an empty scattered plan), after planning O(W x tensors) on rank 0:
# over a minute for the MoE at W = 8. It is tried where W x tensors is small only, to show the failure.
FAKE_DCP_SAVE_LIMIT = 10_000


# ---------------------------------------------------------------- models


def count(default: int) -> Any:
    """A dimension that scaling down keeps (how many layers or experts), not a hidden size."""
    return field(default=default, metadata={"count": True})


@dataclass(frozen=True)
class DenseDims:
    """Llama-3-70B."""

    layers: int = count(80)
    hidden: int = 8192
    intermediate: int = 28672
    kv: int = 1024  # 8 key-value heads of 128
    vocab: int = 128256


@dataclass(frozen=True)
class MoEDims:
    """DeepSeek-V3: multi-head latent attention, 3 dense layers, then 256 routed experts and a shared one."""

    layers: int = count(61)
    dense_layers: int = count(3)
    experts: int = count(256)
    hidden: int = 7168
    intermediate: int = 18432
    expert_intermediate: int = 2048
    q_lora: int = 1536
    q_heads: int = 24576  # 128 heads x (128 + 64 rope)
    kv_lora: int = 512
    rope: int = 64
    kv_heads: int = 32768  # 128 heads x (128 key + 128 value)
    v_heads: int = 16384  # 128 heads x 128
    vocab: int = 129280


Dims = DenseDims | MoEDims


def scaled(dims: Dims, k: int) -> Dims:
    """Every hidden size divided by ``k`` (at least 1); layer and expert counts kept."""
    sizes = {f.name: max(1, getattr(dims, f.name) // k) for f in dataclasses.fields(dims) if not f.metadata}
    return dataclasses.replace(dims, **sizes)


class Node(nn.Module):
    """A module holding the children it is given: names and shapes are all that is measured (no forward)."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class DecoderLayer(Node):
    """The unit every engine shards on its own."""


class Router(nn.Module):
    """DeepSeek-V3's top-k router as Hugging Face holds it: a weight and a bias buffer."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden).normal_(std=0.02))  # (zero.Init keeps it)
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))


def linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


def mlp(hidden: int, intermediate: int) -> Node:
    return Node(
        gate_proj=linear(hidden, intermediate),
        up_proj=linear(hidden, intermediate),
        down_proj=linear(intermediate, hidden),
    )


def dense_layer(d: DenseDims) -> DecoderLayer:
    attention = Node(
        q_proj=linear(d.hidden, d.hidden),
        k_proj=linear(d.hidden, d.kv),
        v_proj=linear(d.hidden, d.kv),
        o_proj=linear(d.hidden, d.hidden),
    )
    return DecoderLayer(
        self_attn=attention,
        mlp=mlp(d.hidden, d.intermediate),
        input_layernorm=nn.RMSNorm(d.hidden),
        post_attention_layernorm=nn.RMSNorm(d.hidden),
    )


def moe_layer(d: MoEDims, index: int) -> DecoderLayer:
    attention = Node(
        q_a_proj=linear(d.hidden, d.q_lora),
        q_a_layernorm=nn.RMSNorm(d.q_lora),
        q_b_proj=linear(d.q_lora, d.q_heads),
        kv_a_proj_with_mqa=linear(d.hidden, d.kv_lora + d.rope),
        kv_a_layernorm=nn.RMSNorm(d.kv_lora),
        kv_b_proj=linear(d.kv_lora, d.kv_heads),
        o_proj=linear(d.v_heads, d.hidden),
    )
    if index < d.dense_layers:
        feed_forward = mlp(d.hidden, d.intermediate)
    else:
        feed_forward = Node(
            gate=Router(d.experts, d.hidden),
            experts=nn.ModuleList(mlp(d.hidden, d.expert_intermediate) for _ in range(d.experts)),
            shared_experts=mlp(d.hidden, d.expert_intermediate),
        )
    return DecoderLayer(
        self_attn=attention,
        mlp=feed_forward,
        input_layernorm=nn.RMSNorm(d.hidden),
        post_attention_layernorm=nn.RMSNorm(d.hidden),
    )


def build_model(name: str, k: int) -> nn.Module:
    """The model ``name`` with hidden sizes divided by ``k``, on the current default device."""
    dims = scaled(DenseDims() if name == "dense" else MoEDims(), k)
    layer = (lambda index: dense_layer(dims)) if name == "dense" else (lambda index: moe_layer(dims, index))
    body = Node(
        embed_tokens=nn.Embedding(dims.vocab, dims.hidden),
        layers=nn.ModuleList(layer(index) for index in range(dims.layers)),
        norm=nn.RMSNorm(dims.hidden),
    )
    return Node(model=body, lm_head=linear(dims.hidden, dims.vocab))


COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj"})
ROWWISE = frozenset({"o_proj", "down_proj"})


def tp_plan(layer: nn.Module) -> dict[str, Any]:
    """Tensor parallel inside a layer, Megatron's way: projections in column-wise, out row-wise
    (every expert's too); the low-rank attention inputs, the router and the norms replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for path, _ in layer.named_modules():
        leaf = path.rpartition(".")[2]
        if leaf in COLWISE:
            plan[path] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[path] = RowwiseParallel()
    return plan


@dataclass(frozen=True)
class Sizes:
    """A model's tensors and elements at its real shapes."""

    tensors: int
    numel: int


@functools.cache
def model_sizes(name: str) -> Sizes:
    with torch.device("meta"):
        model = build_model(name, 1)
    tensors = [*model.parameters(), *model.buffers()]
    return Sizes(len(tensors), sum(t.numel() for t in tensors))


# ---------------------------------------------------------------- engines


def tp_degree(world: int, most: int = 8) -> int:
    """Tensor-parallel ranks: ``most`` (8) where W leaves a data-parallel dim of 2 or more beside, else W/2."""
    return max(1, min(most, world // 2))


def hsdp_mesh_shape(world: int, shard: int) -> tuple[int, int, int]:
    """(replicate, shard, tp): tp from ``tp_degree``, up to ``shard`` data-parallel ranks sharding,
    the rest replicas."""
    tp = tp_degree(world)
    sharding = math.gcd(world // tp, shard)
    return world // (tp * sharding), sharding, tp


def sharding_ways(engine: str, world: int, hsdp_shard: int) -> int:
    """Into how many pieces the engine cuts the model (HSDP replicates it over the replicate dim)."""
    if engine == "hsdp_tp":
        _, sharding, tp = hsdp_mesh_shape(world, hsdp_shard)
        return sharding * tp
    return world


def auto_scale_down(sizes: Sizes, engine: str, world: int, hsdp_shard: int, budget_mib: float) -> int:
    """The smallest power of two K whose model (hidden sizes / K, so numel / K^2) fits the budget on one rank:
    its shards under the DTensor engines, all of it under FSDP1 and ZeRO-3 (each tensor passes whole)."""
    pieces = 1 if engine in ("fsdp1", "zero3") else sharding_ways(engine, world, hsdp_shard)
    k = 1
    while sizes.numel * 4 / pieces / k**2 > budget_mib * 2**20:
        k *= 2
    return k


@torch.no_grad()
def fill(tensors: Iterable[torch.Tensor]) -> None:
    """Give freshly materialised (uninitialised) tensors finite values, shard by shard."""
    from torch.distributed.tensor import DTensor

    for tensor in tensors:
        (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).uniform_(-0.02, 0.02)


class LazyChunks(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` chunks, as FSDP2's
    ``_chunk_with_empty`` returns it, each chunk made when indexed. FSDP2 takes one chunk (this
    rank's) and the first one's size of each parameter, but makes all W: 10 s for the dense model's
    723 tensors at W = 4,096, 95 s for the MoE's 45,395 at W = 512, in every rank of a real job as
    here. The same views, so the same shards (``--torch-chunks`` times torch's own)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        if not 0 <= index < self.num_chunks:
            raise IndexError(index)
        size = self.tensor.size(self.dim)
        step = -(-size // self.num_chunks)
        if size == 0:
            return self.tensor.narrow(self.dim, 0, 0)
        if index * step >= size:
            return self.tensor.narrow(self.dim, 0, min(step, size)).new_empty(0)
        return self.tensor.narrow(self.dim, index * step, min(step, size - index * step))


def use_lazy_fsdp2_chunks() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    _fsdp_param._chunk_with_empty = LazyChunks


def shard_fsdp2(name: str, k: int, world: int, hsdp_shard: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = build_model(name, k)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return materialised(model)


def shard_hsdp_tp(name: str, k: int, world: int, hsdp_shard: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    shape = hsdp_mesh_shape(world, hsdp_shard)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    data_parallel = mesh["replicate", "shard"]
    with torch.device("meta"):
        model = build_model(name, k)
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], tp_plan(layer))
        fully_shard(layer, mesh=data_parallel)
    outer = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel()}
    parallelize_module(model, mesh["tp"], outer)
    fully_shard(model, mesh=data_parallel)
    return materialised(model)


def materialised(model: nn.Module) -> nn.Module:
    model.to_empty(device="cpu")
    fill(model.parameters())
    fill(model.buffers())
    return model


def shard_fsdp1(name: str, k: int, world: int, hsdp_shard: int) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def materialise(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        fill(module.parameters(recurse=False))
        fill(module.buffers(recurse=False))

    with torch.device("meta"):
        model = build_model(name, k)
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}),
        device_id=torch.device("cpu"),
        param_init_fn=materialise,
        use_orig_params=True,
    )


def shard_zero3(name: str, k: int, world: int, hsdp_shard: int) -> nn.Module:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    config = {"train_batch_size": world, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):
        return build_model(name, k)


SHARD: dict[str, Callable[[str, int, int, int], nn.Module]] = {
    "fsdp2": shard_fsdp2,
    "hsdp_tp": shard_hsdp_tp,
    "fsdp1": shard_fsdp1,
    "zero3": shard_zero3,
}


def local_bytes(model: nn.Module) -> int:
    """Bytes of this rank's shards, as the engine holds them (FSDP1: its flat parameters' chunks, padding included)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    units = [m._handle.flat_param for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m._handle]
    total = 0
    for tensor in units or [*model.parameters(), *model.buffers()]:
        held = getattr(tensor, "ds_tensor", None)
        held = held if held is not None else tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        total += held.numel() * held.element_size()
    return total


# ---------------------------------------------------------------- measuring


@dataclass
class Run:
    """One simulated rank: what the sweep hands a subprocess."""

    model: str
    engine: str
    world: int
    rank: int
    scale_down: int
    hsdp_shard: int
    torch_chunks: bool  # FSDP2's own chunking (slow at large W), not ``LazyChunks``


class Record(dict):
    """A run's results, written to ``path`` at every entry, so a run killed part-way still reports what it measured."""

    def __init__(self, path: Path | None, **entries: Any) -> None:
        super().__init__(entries)
        self.path = path
        self.flush()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            staged = self.path.with_suffix(".tmp")
            staged.write_text(json.dumps(self))
            staged.replace(self.path)


def rss_mib() -> float:
    """This process's resident memory now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def failure(error: BaseException) -> str:
    """The error's first line, bounded (DCP's plan errors list every tensor); for DCP's
    ``CheckpointException``, each failed rank's error."""
    causes = getattr(error, "failures", None)  # {rank: (exception, traceback)}
    if isinstance(causes, dict) and causes:
        return "; ".join(f"rank {rank}: {failure(cause[0])}" for rank, cause in causes.items())
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


FAILED = object()  # what ``attempt`` returns for a stage that raised


def attempt(record: Record, name: str, call: Callable[[], Any], timed: str | None = None) -> Any:
    """Run stage ``name``: ``call()``'s result, its seconds into ``record[timed]`` if given, or on an
    error (DCP raises ``CheckpointException``, a ``BaseException``) the error into ``record["errors"]``
    and ``FAILED``. The stage is recorded first, so a run killed during it says where."""
    from torch.distributed.checkpoint.api import CheckpointException

    record["stage"] = name
    gc.collect()
    start = time.perf_counter()
    try:
        result = call()
    except (Exception, CheckpointException) as error:
        record["errors"] = {**record.get("errors", {}), name: failure(error)}
        return FAILED
    if timed:
        record[timed] = time.perf_counter() - start
    return result


def build_model_on_rank(run: Run, record: Record) -> Any:
    """The sharded, materialised model (or ``FAILED``), with what building it cost."""
    if not run.torch_chunks:
        use_lazy_fsdp2_chunks()
    gc.collect()  # (under --real, the previous engine's model: FSDP's modules and hooks hold cycles)
    rss_before = rss_mib()
    model = attempt(
        record, "model", lambda: SHARD[run.engine](run.model, run.scale_down, run.world, run.hsdp_shard), "model_s"
    )
    if model is not FAILED:
        record["tensors"] = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
        record["model_local_mib"] = local_bytes(model) / 2**20
        record["model_rss_mib"] = rss_mib() - rss_before
    return model


def traced_peak_mib(build: Callable[[], object]) -> float:
    """Peak Python memory traced while ``build()`` runs (tensor storage is not traced: the Python side of it)."""
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def update_ms(averager: Any) -> float:
    averager.update()  # the first copies
    times = []
    for _ in range(UPDATE_REPEATS):
        start = time.perf_counter()
        averager.update()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bytes_floor_ms(averager: Any) -> float:
    """The least an update with the non-finite check can take here: the bytes it must move (each
    local shard read twice, by the screen and by the update; each shadow read and written once)
    at the memory's speed measured now, in this process, as ``tools/bench.py`` measures it: the
    faster of a streaming copy and ``b += a`` (the update's own pattern) over 64 MiB."""
    live = sum(info.local_numel * info.dtype.itemsize for info in averager.tensors)
    moved = 2 * live + 2 * averager.shadow_bytes()
    a, b = torch.ones(64 * 2**20 // 4), torch.ones(64 * 2**20 // 4)
    rates = []
    for stream, nbytes in ((lambda: b.copy_(a), 2 * a.nbytes), (lambda: b.add_(a), 3 * a.nbytes)):
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            stream()
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / best)
    return moved / max(rates) * 1e3


def measure_averager(model: nn.Module, directory: Path, record: Record) -> None:
    """Build a ``WeightAverager`` over ``model`` and use it (``measure_built``), build it again under
    tracemalloc, and last (the slowest, and failing under the fake group) ``dcp.save`` it; each stage
    into ``record``."""
    import shardavg

    def build() -> shardavg.WeightAverager:
        return shardavg.WeightAverager(model, shardavg.EMA(0.999))

    averager = attempt(record, "construction", build, "construction_s")
    if averager is FAILED:
        return
    measure_built(averager, directory, record)
    record["rss_mib"] = peak_rss_mib()
    peak = attempt(record, "construction (traced)", lambda: traced_peak_mib(build))
    if peak is not FAILED:
        record["peak_traced_mib"] = peak
    measure_dcp_save(averager, directory / "dcp", record)


def measure_built(averager: Any, directory: Path, record: Record) -> None:
    """Update, save and load ``averager`` (a failed save skips the load), and take its DCP state dict."""
    record["tracked"] = len(averager.tensors)
    record["live_dtypes"] = sorted({str(info.dtype).removeprefix("torch.") for info in averager.tensors})
    record["shadow_mib"] = averager.shadow_bytes() / 2**20
    milliseconds = attempt(record, "update", lambda: update_ms(averager))
    if milliseconds is not FAILED:
        record["update_ms"] = milliseconds
        record["update_floor_ms"] = bytes_floor_ms(averager)
    saved = directory / "averager"
    if attempt(record, "save", lambda: averager.save(saved), "save_s") is not FAILED:
        manifest = saved / "shardavg.json"
        record["manifest_kib"] = manifest.stat().st_size / 2**10 if manifest.exists() else None
        attempt(record, "load", lambda: averager.load(saved), "load_s")
    attempt(record, "dcp_state_dict", averager.state_dict, "dcp_state_dict_s")
    attempt(record, "export", lambda: export(averager, directory / "export", record), "export_s")


def export(averager: Any, directory: Path, record: Record) -> None:
    """The consolidated export. Rank 0 writes with every rank (it plans for all W writers, creates
    the files, writes its 1/W, commits); under the fake group another rank cannot (no rank 0
    creates the files it would write into), so there it exports with ``writers=1``: what it costs
    a rank that only sends its parts."""
    alone = record["mode"] == "fake" and record["rank"] != 0
    averager.export(directory, writers=1 if alone else None)


def measure_dcp_save(averager: Any, directory: Path, record: Record) -> None:
    import torch.distributed.checkpoint as dcp

    if "dcp_state_dict" in record.get("errors", {}):
        return
    if record["mode"] == "fake" and record["world"] * record["tracked"] > FAKE_DCP_SAVE_LIMIT:
        record["skipped"] = {"dcp_save": f"not tried under the fake group at W x tensors > {FAKE_DCP_SAVE_LIMIT}"}
    else:
        attempt(record, "dcp_save", lambda: dcp.save({"ema": averager}, checkpoint_id=directory), "dcp_save_s")


def measure_run(run: Run, directory: Path, record: Record) -> None:
    """Everything measured on one rank, the model's own cost first; failures are in ``record["errors"]``."""
    model = build_model_on_rank(run, record)
    if model is not FAILED:
        measure_averager(model, directory, record)
    record["stage"] = "done"
    if "rss_mib" not in record:  # (set after the averager's load and state dict, where it got that far)
        record["rss_mib"] = peak_rss_mib()


# ---------------------------------------------------------------- one simulated rank (a subprocess)


def simulate(run: Run, result: Path) -> None:
    """Run as rank ``run.rank`` of ``run.world`` under the fake process group; results go to ``result``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    os.environ.update(RANK=str(run.rank), WORLD_SIZE=str(run.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    record = Record(result, **dataclasses.asdict(run), mode="fake")
    dist.init_process_group("fake", store=FakeStore(), rank=run.rank, world_size=run.world)
    with tempfile.TemporaryDirectory(prefix="scale-") as directory:
        measure_run(run, Path(directory), record)


def child_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**10
    return 0.0


def launch(run: Run, timeout: float, max_rss_gib: float) -> dict[str, Any]:
    """Run one simulated rank in a fresh process; kill it past ``timeout`` seconds or ``max_rss_gib``."""
    with tempfile.TemporaryDirectory(prefix="scale-run-") as scratch:
        result = Path(scratch) / "result.json"
        stderr_path = Path(scratch) / "stderr"
        command = [sys.executable, __file__, "--simulate", json.dumps(dataclasses.asdict(run)), "--result", str(result)]
        environment = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        with stderr_path.open("w") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=environment)
            killed = watch(process, timeout, max_rss_gib)
        record = json.loads(result.read_text()) if result.exists() else dataclasses.asdict(run) | {"mode": "fake"}
        if killed or process.returncode != 0:
            tail = stderr_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
            what = killed or f"exit {process.returncode}: {tail[0][:400]}"
            record["errors"] = {**record.get("errors", {}), record.get("stage", "model"): what}
        return record


def watch(process: subprocess.Popen, timeout: float, max_rss_gib: float) -> str | None:
    """Wait for ``process``; kill it past ``timeout`` or ``max_rss_gib``, saying why."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        reason = None
        if time.monotonic() > deadline:
            reason = f"killed after {timeout:.0f} s"
        elif child_rss_mib(process.pid) > max_rss_gib * 2**10:
            reason = f"killed at RSS > {max_rss_gib:g} GiB"
        if reason:
            process.kill()
            process.wait()
            return reason
        time.sleep(0.2)
    return None


def sweep_runs(args: argparse.Namespace) -> list[Run]:
    """Every (model, engine, W), each as rank 0 and rank W-1."""
    runs = []
    for model in args.models:
        for engine in args.engines:
            for world in args.worlds:
                k = scale_down(args, model, engine, world)
                for rank in sorted({0, world - 1}):
                    runs.append(Run(model, engine, world, rank, k, args.hsdp_shard, args.torch_chunks))
    return runs


def scale_down(args: argparse.Namespace, model: str, engine: str, world: int) -> int:
    """The hidden-size divisor K of a run: ``--scale-down``, its per-run choice with 'auto', or the default."""
    if args.scale_down == "auto":
        return auto_scale_down(model_sizes(model), engine, world, args.hsdp_shard, args.budget_mib)
    return args.scale_down or (REAL_SCALE_DOWN if args.real else SCALE_DOWN[model])


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(Run))


def previous_records(path: Path | None) -> list[dict[str, Any]]:
    """The simulated runs an earlier sweep recorded in ``path`` (``--resume``), the last record of each."""
    if path is None or not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = {tuple(record[key] for key in RUN_FIELDS): record for record in records if record.get("mode") == "fake"}
    return list(last.values())


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tqdm import tqdm

    records = previous_records(args.json) if args.resume else []
    done = [{key: record[key] for key in RUN_FIELDS} for record in records]
    runs = [run for run in sweep_runs(args) if dataclasses.asdict(run) not in done]
    with tqdm(runs, unit="run") as progress:
        for run in progress:
            progress.set_description(f"{run.model} {run.engine} W={run.world} rank {run.rank}")
            record = launch(run, args.timeout, args.max_rss_gib)
            for stage_name, message in record.get("errors", {}).items():
                log.warning(
                    "%s %s W=%d rank %d: %s: %s", run.model, run.engine, run.world, run.rank, stage_name, message
                )
            records.append(record)
            write_json(args.json, [record])
    if any("dcp_save" in record.get("errors", {}) for record in records):
        log.warning(
            "dcp.save cannot run under the fake process group: rank 0 validates a global plan made of W copies "
            "of its own local plan (what the fake gather returns) and finds the tensors not covered; the other "
            "ranks unpickle the scattered global plan from an empty buffer (EOFError)"
        )
    return records


# ---------------------------------------------------------------- real ranks (torchrun)


def real(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (model, engine) under the real process group (gloo); rank 0's and rank W-1's records."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    me, world = dist.get_rank(), dist.get_world_size()
    records = []
    for model in args.models:
        for engine in args.engines:
            k = scale_down(args, model, engine, world)
            run = Run(model, engine, world, me, k, args.hsdp_shard, args.torch_chunks)
            record = Record(None, **dataclasses.asdict(run), mode="real")
            with shared_folder() as directory:
                measure_run(run, directory, record)
            everyone: list[dict] = [{}] * world
            dist.all_gather_object(everyone, dict(record))
            records += [everyone[0], everyone[-1]] if world > 1 else everyone
            if me == 0:
                log.info("%s %s: %s", model, engine, everyone[0].get("errors", "done"))
    return records


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A temporary folder all ranks write into: rank 0 makes it, and removes it once every rank is done."""
    name = [tempfile.mkdtemp(prefix="scale-real-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name)
    try:
        yield Path(name[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(name[0], ignore_errors=True)


# ---------------------------------------------------------------- output


COLUMNS = (
    "model",
    "engine",
    "W",
    "K",
    "tensors",
    "model s",
    "model RSS MiB",
    "construction s",
    "peak traced MiB",
    "RSS MiB",
    "update ms",
    "update x bytes floor",
    "save rank0 s",
    "save other s",
    "load s",
    "manifest KiB",
    "DCP state_dict s",
    "DCP save s",
    "export rank0 s",
    "export other s",
)


def write_json(path: Path | None, records: list[dict[str, Any]]) -> None:
    if path is not None:
        with path.open("a") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")


def cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"
    return str(value)


def grouped(records: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Records by (mode, model, engine, W) in that order, rank 0's first."""

    def order(record: dict[str, Any]) -> tuple:
        return record["mode"], MODELS.index(record["model"]), ENGINES.index(record["engine"]), record["world"]

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (order(r), r["rank"])):
        groups.setdefault((record["mode"], record["model"], record["engine"], record["world"]), []).append(record)
    return groups


def slowest(ranks: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


# Where a stage's failure shows in the table (save: the rank's own column)
STAGE_COLUMNS = {
    "model": "model s",
    "construction": "construction s",
    "construction (traced)": "peak traced MiB",
    "update": "update ms",
    "load": "load s",
    "dcp_state_dict": "DCP state_dict s",
    "dcp_save": "DCP save s",
}


def row(ranks: list[dict[str, Any]]) -> list[str]:
    """One table row: the slower of the ranks, each rank's own save, a failure in its stage's column."""
    first, last = ranks[0], ranks[-1]
    other = last if len(ranks) > 1 else {}
    values = {
        "model": first["model"],
        "engine": first["engine"] + "".join(f" ({d} live)" for d in first.get("live_dtypes", []) if d != "float32"),
        "W": first["world"],
        "K": first["scale_down"],
        "tensors": first.get("tensors"),
        "save rank0 s": first.get("save_s"),
        "save other s": other.get("save_s"),
        "export rank0 s": first.get("export_s"),
        "export other s": other.get("export_s"),
        "manifest KiB": first.get("manifest_kib"),
    }
    slowest_of = {
        "model s": "model_s",
        "model RSS MiB": "model_rss_mib",
        "construction s": "construction_s",
        "peak traced MiB": "peak_traced_mib",
        "RSS MiB": "rss_mib",
        "update ms": "update_ms",
        "load s": "load_s",
        "DCP state_dict s": "dcp_state_dict_s",
        "DCP save s": "dcp_save_s",
    }
    values |= {column: slowest(ranks, key) for column, key in slowest_of.items()}
    floors = [r["update_floor_ms"] for r in ranks if r.get("update_floor_ms")]  # the slowest update, the most bytes
    values["update x bytes floor"] = values["update ms"] / max(floors) if floors and values["update ms"] else None
    cells = {column: cell(value) for column, value in values.items()}
    failures: dict[str, list[str]] = {}
    for record in ranks:
        for name, message in record.get("errors", {}).items():
            column = STAGE_COLUMNS.get(name, "model s")
            if name in ("save", "export"):
                column = f"{name} {'rank0' if record['rank'] == 0 else 'other'} s"
            failures.setdefault(column, []).append(message)
    for column, messages in failures.items():
        cells[column] = "fails: " + "; ".join(dict.fromkeys(m[:100] for m in messages))
    if any("dcp_save" in record.get("skipped", {}) for record in ranks):
        cells["DCP save s"] = "not tried"
    return [cells[column].replace("|", "/") for column in COLUMNS]


def table(records: list[dict[str, Any]]) -> str:
    rows = [row(ranks) for ranks in grouped(records).values()]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Log-log: construction time and peak traced memory against W, one line per model x engine (the
    slower rank), labelled with the scale-down K of its runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    lines: dict[tuple[str, str, str], list[list[dict[str, Any]]]] = {}
    for (mode, model, engine, _), ranks in grouped(records).items():
        lines.setdefault((model, engine, mode), []).append(ranks)
    for (model, engine, mode), runs in sorted(lines.items()):
        scales = "/".join(str(k) for k in dict.fromkeys(ranks[0]["scale_down"] for ranks in runs))
        label = f"{model} {engine} K={scales}" + (" (real)" if mode == "real" else "")
        for axis, key in zip(axes, ("construction_s", "peak_traced_mib")):
            points = sorted((ranks[0]["world"], slowest(ranks, key)) for ranks in runs)
            points = [(world, value) for world, value in points if value is not None]
            if points:
                axis.plot(*zip(*points), marker="o", label=label)
    for axis, what in zip(axes, ("averager construction (s)", "peak traced Python memory, construction (MiB)")):
        axis.set(xscale="log", yscale="log", xlabel="world size W", ylabel=what)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    log.info("plot: %s", path)


# ---------------------------------------------------------------- command line


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS), help="simulated world sizes")
    parser.add_argument(
        "--scale-down",
        type=lambda text: text if text == "auto" else int(text),
        default=None,
        metavar="K",
        help=f"divide hidden sizes by K (default: {SCALE_DOWN}; --real: {REAL_SCALE_DOWN}); 'auto': per run, "
        "the smallest power of two within --budget-mib",
    )
    parser.add_argument("--budget-mib", type=float, default=1024, help="what one rank materialises, for 'auto'")
    parser.add_argument("--hsdp-shard", type=int, default=64, help="hsdp_tp: data-parallel ranks that shard, at most")
    parser.add_argument("--torch-chunks", action="store_true", help="FSDP2's own chunking, not LazyChunks")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per simulated run")
    parser.add_argument("--max-rss-gib", type=float, default=6, help="kill a simulated run above this RSS")
    parser.add_argument("--json", type=Path, help="append each run's record here, one JSON line each")
    parser.add_argument("--resume", action="store_true", help="skip the runs --json holds already, and show them")
    parser.add_argument("--plot", type=Path, help="a log-log figure of construction time and memory against W")
    parser.add_argument("--real", action="store_true", help="under torchrun: real ranks and gloo, not simulated")
    parser.add_argument("--simulate", help=argparse.SUPPRESS)  # one simulated run (JSON), from the sweep
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.simulate:
        simulate(Run(**json.loads(args.simulate)), args.result)
        os._exit(0)  # all is recorded: tearing down the model's objects (45,000 FSDP parameters) is not measured
    records = real(args) if args.real else sweep(args)
    if args.real and dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    if args.real:
        write_json(args.json, records)
    if args.plot:
        plot(records, args.plot)
    print(table(records))
    if args.real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
