"""shardavg's update side by side with the ways people average a sharded model today.

    torchrun --nproc_per_node 2 -m tools.bench --config configs/bench.yaml [--json bench.json]
    torchrun --nproc_per_node 4 -m tools.bench --config configs/bench.yaml --set "engines=[fsdp2_tp]"

For each engine, model shape and live dtype it times, on the slowest rank after warm-up:
``ours`` (``WeightAverager.update()``, with the non-finite check and with ``on_nonfinite="off"``),
the engine's gather-based peer (DDP: a full ``AveragedModel`` replica; FSDP1:
``summon_full_params``; FSDP2 and FSDP2 + tensor parallel: ``full_tensor()`` per parameter;
ZeRO-3: ``GatheredParameters`` per parameter; each with an fp32 EMA into a full copy), and the floor
(the same fused kernels
over plain tensors of this rank's local-shard sizes) and the copy floor (a ``_foreach_copy_`` of
the live shards into fp32 tensors: the least any update moves). ``device: cuda`` in the config
runs it on each rank's GPU over NCCL (one GPU per rank), the clock stopped after a device sync;
the achieved GB/s counts the bytes an update must move (read the live shard, read and write
the fp32 shadow). The methods take turns on each new set of
live weights, so every one sees the same sequence (and ours is checked against the reference's
average) and a drift in the machine's speed falls on all of them alike. It also measures bytes received
per update, the average's extra bytes per rank, and the consolidated export against torch's
own full state dict (or DeepSpeed's) saved with safetensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from launch import config as configs
from launch import engines
from shardavg import EMA, SWA, WeightAverager
from shardavg.strategies import canonical_name
from tools.measure import CommCounter, allocated_peak, copy_bandwidth, interleaved_ms

log = logging.getLogger("bench")


# ----------------------------------------------------------------------------- models


class Layer(nn.Module):
    """A transformer layer's parameters: attention projections, an MLP and two LayerNorms."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


class SmallBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)


def build_model(shape: dict) -> tuple[nn.Module, type[nn.Module]]:
    """The model and the block class the engines shard on."""
    torch.manual_seed(0)
    if shape["kind"] == "transformer":
        return nn.Sequential(*(Layer(shape["dim"]) for _ in range(shape["layers"]))), Layer
    if shape["kind"] == "many_small":
        return nn.Sequential(*(SmallBlock(shape["width"]) for _ in range(shape["blocks"]))), SmallBlock
    raise configs.ConfigError(f"shapes: unknown kind {shape['kind']!r}; expected transformer or many_small")


# ----------------------------------------------------------------------------- methods


@dataclass
class Method:
    """One way to keep an EMA: ``update()`` per step, ``result()`` the full fp32 average on rank 0."""

    name: str
    role: str  # "ours", "reference" (an fp32 EMA of the full weights, what ours is checked against), "peer", "floor"
    update: Callable[[], object]
    result: Callable[[], dict | None]
    extra_bytes: Callable[[], int]  # what the average keeps on this rank, read after the updates


def ema_into(copies: dict[str, torch.Tensor] | None, full: dict[str, torch.Tensor], decay: float) -> dict:
    """The peers' update: an fp32 EMA of full tensors into a full copy (the first one copies)."""
    if copies is None:
        return {name: value.detach().float().clone() for name, value in full.items()}
    names = list(copies)
    torch._foreach_lerp_([copies[n] for n in names], [full[n].detach().float() for n in names], 1 - decay)
    return copies


def ours(wrapped: engines.Wrapped, decay: float, check: bool) -> Method:
    average = WeightAverager(wrapped.model, EMA(decay=decay), on_nonfinite="raise" if check else "off")
    name = "ours" if check else "ours, check off"
    return Method(name, "ours", average.update, average.full_state_dict, average.shadow_bytes)


SEVERAL = {"ema": EMA(decay=0.999), "slow": EMA(decay=0.9999), "swa": SWA()}  # the first one is checked


def several_in_one(wrapped: engines.Wrapped) -> Method:
    """Three averages kept by one averager: one read, screen and staging of the live shards."""
    average = WeightAverager(wrapped.model, SEVERAL)
    result = lambda: average.full_state_dict("ema")  # noqa: E731
    return Method("3 averages, one averager", "several", average.update, result, average.shadow_bytes)


def several_apart(wrapped: engines.Wrapped) -> Method:
    """The same three averages as three averagers, each reading the live shards itself."""
    averages = [WeightAverager(wrapped.model, rule) for rule in SEVERAL.values()]

    def update() -> None:
        for average in averages:
            average.update()

    extra = lambda: sum(a.shadow_bytes() for a in averages)  # noqa: E731
    return Method("3 averages, three averagers", "several", update, averages[0].full_state_dict, extra)


def floor(wrapped: engines.Wrapped, decay: float) -> Method:
    """The update's kernels alone, over plain tensors shaped like this rank's local shards."""
    lives = [shard.detach().clone() for shard in wrapped.local_shards() if shard.numel()]
    shadows = [torch.zeros_like(live, dtype=torch.float32) for live in lives]
    weight = 1 - decay

    def update() -> None:
        if lives[0].dtype == torch.float32:
            torch._foreach_lerp_(shadows, lives, weight)
        else:  # what ours does for mixed dtypes
            torch._foreach_mul_(shadows, 1 - weight)
            torch._foreach_add_(shadows, lives, alpha=weight)

    return Method("floor", "floor", update, lambda: None, lambda: sum(s.nbytes for s in shadows))


def copy_floor(wrapped: engines.Wrapped) -> Method:
    """A device-to-device copy of the live shards into fp32 tensors of their sizes: reading the
    live weights and writing the shadows' bytes once, with nothing averaged."""
    lives = [shard.detach().clone() for shard in wrapped.local_shards() if shard.numel()]
    targets = [torch.zeros_like(live, dtype=torch.float32) for live in lives]
    update = lambda: torch._foreach_copy_(targets, lives)  # noqa: E731
    return Method("copy floor", "copy", update, lambda: None, lambda: sum(t.nbytes for t in targets))


def replica(wrapped: engines.Wrapped, decay: float) -> Method:
    """DDP: a full ``AveragedModel`` on every rank (the torch recipe)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    average = AveragedModel(wrapped.module, multi_avg_fn=get_ema_multi_avg_fn(decay))

    def result() -> dict | None:
        return {n: p.detach().float() for n, p in average.module.named_parameters()} if dist.get_rank() == 0 else None

    update = lambda: average.update_parameters(wrapped.module)  # noqa: E731
    extra = lambda: sum(t.nbytes for t in average.module.state_dict().values())  # noqa: E731
    return Method("full replica (AveragedModel)", "peer", update, result, extra)


def full_copy(wrapped: engines.Wrapped, decay: float) -> Method:
    """DDP: an fp32 EMA of the (already whole) weights into a full copy, the reference for DDP;
    ``AveragedModel`` keeps its copy in the live dtype and cannot lerp bf16 weights into fp32."""
    state: dict = {"copies": None}

    def update() -> None:
        full = {n: p for n, p in wrapped.module.named_parameters()}
        state["copies"] = ema_into(state["copies"], full, decay)

    result = lambda: state["copies"] if dist.get_rank() == 0 else None  # noqa: E731
    return Method(
        "fp32 full copy", "reference", update, result, lambda: sum(c.nbytes for c in state["copies"].values())
    )


def gathering(wrapped: engines.Wrapped, decay: float) -> Method:
    """FSDP1, FSDP2, ZeRO-3: gather the full weights with the engine's own API, EMA into a full fp32 copy."""
    state: dict = {"copies": None}

    def full_weights() -> None:
        if wrapped.kind == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(wrapped.model, writeback=False):
                full = {canonical_name(n): p for n, p in wrapped.model.named_parameters()}
                state["copies"] = ema_into(state["copies"], full, decay)
        elif wrapped.kind == "zero3":
            import deepspeed

            for name, param in wrapped.module.named_parameters():
                with deepspeed.zero.GatheredParameters([param]):
                    state["copies"] = ema_into_one(state["copies"], name, param, decay)
        else:
            for name, param in wrapped.module.named_parameters():
                state["copies"] = ema_into_one(state["copies"], name, param.full_tensor(), decay)

    label = {"fsdp1": "summon_full_params", "zero3": "GatheredParameters"}.get(wrapped.kind, "full_tensor()")
    return Method(
        f"{label} + full copy",
        "reference",
        full_weights,
        lambda: state["copies"] if dist.get_rank() == 0 else None,
        lambda: sum(copy.nbytes for copy in state["copies"].values()),
    )


def ema_into_one(copies: dict | None, name: str, value: torch.Tensor, decay: float) -> dict:
    copies = {} if copies is None else copies
    if name not in copies:
        copies[name] = value.detach().float().clone()
    else:
        copies[name].lerp_(value.detach().float(), 1 - decay)
    return copies


def methods(wrapped: engines.Wrapped, decay: float) -> list:
    peers = [replica, full_copy] if wrapped.kind == "ddp" else [gathering]
    return [
        lambda: ours(wrapped, decay, check=True),
        lambda: ours(wrapped, decay, check=False),
        lambda: several_in_one(wrapped),
        lambda: several_apart(wrapped),
        *(lambda peer=peer: peer(wrapped, decay) for peer in peers),
        lambda: floor(wrapped, decay),
        lambda: copy_floor(wrapped),
    ]


# ----------------------------------------------------------------------------- measuring


@dataclass
class Row:
    engine: str
    shape: str
    dtype: str
    method: str
    role: str
    ms_median: float
    ms_p90: float
    comm_bytes_per_update: int
    extra_bytes_per_rank: int
    check: str
    gb_per_s: float = 0.0  # bytes an update must move (live read, shadow read and write) / time


def compare(got: dict | None, want: dict | None, dtype: torch.dtype, failing: str) -> str:
    """Rank 0: ``bitwise``, ``close (max rel ...)`` or ``failing`` of an average against the reference."""
    if dist.get_rank() != 0:
        return ""
    names = sorted(want)
    got, want = {n: t.detach().cpu() for n, t in got.items()}, {n: t.detach().cpu() for n, t in want.items()}
    missing = sorted(set(names) - set(got))
    if missing:
        return f"FAIL: missing {missing[:3]}"
    if all(torch.equal(got[n].float(), want[n]) for n in names):
        return "bitwise"
    worst = max(((got[n].float() - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)).item() for n in names)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    return f"close (max rel {worst:.1e})" if worst <= tolerance else f"{failing} (max rel {worst:.1e})"


def run_case(kind: str, shape_name: str, shape: dict, dtype: torch.dtype, cfg: dict, device: torch.device) -> list[Row]:
    module, block = build_model(shape)
    wrapped = engines.wrap(kind, module, block, dtype, cfg["deepspeed"], parallel=cfg["parallel"], device=device)
    shards = [s for s in wrapped.local_shards() if s.numel()]
    moved = sum(s.nbytes + 2 * 4 * s.numel() for s in shards)  # read live, read and write an fp32 shadow
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def next_weights() -> None:  # what an optimizer step would do: every live shard changes in place
        with torch.no_grad():
            torch._foreach_mul_(shards, 0.999)
            torch._foreach_add_(shards, 0.001)

    initial = [s.detach().clone() for s in shards]
    built = [make() for make in methods(wrapped, cfg["decay"])]
    # The gathering peers change the engine's state (FSDP1 re-registers its parameters, which
    # makes our next update re-verify the model): they take their turns apart from ours, on the
    # same sequence of live weights from the same start.
    phases = [
        [m for m in built if m.role in ("ours", "floor", "copy", "several")],
        [m for m in built if m.role in ("reference", "peer")],
    ]
    measured = {}
    for phase in phases:
        with torch.no_grad():
            torch._foreach_copy_(shards, initial)
        timings = interleaved_ms(
            [m.update for m in phase], cfg["warmup"], cfg["repeats"], before=next_weights, synchronize=synchronize
        )
        next_weights()
        for method, timing in zip(phase, timings):
            with CommCounter().counting() as counter:
                method.update()
            measured[method.name] = (timing, counter.bytes)
    rows, results, reference = [], [], None
    for method in built:
        timing, received = measured[method.name]
        comm, extra = torch.tensor(received), torch.tensor(method.extra_bytes())
        dist.all_reduce(comm, op=dist.ReduceOp.MAX)
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        result = method.result()
        reference = result if method.role == "reference" else reference
        results.append((method.role, result))
        rate = moved / timing.median_ms / 1e6 if method.role in ("ours", "floor", "copy") else 0.0
        rows.append(
            Row(kind, shape_name, str(dtype)[6:], method.name, method.role, timing.median_ms, timing.p90_ms, int(comm),
                int(extra), "", rate)
        )  # fmt: skip
    checks = {
        "ours": "FAIL",
        "several": "FAIL",
        "peer": "differs",
    }  # a peer in bf16 (AveragedModel's copy) loses the average
    for row, (role, result) in zip(rows, results):
        row.check = compare(result, reference, dtype, checks[role]) if role in checks else role.replace("floor", "-")
        row.check = "-" if role == "copy" else row.check
    rows.extend(
        blocked_rows(wrapped, kind, shape_name, dtype, cfg, next_weights, synchronize) if cfg["work_ms"] else []
    )
    rows.extend(export_rows(wrapped, kind, shape_name, dtype, cfg) if cfg["export"] else [])
    return rows


def blocked_rows(
    wrapped: engines.Wrapped, kind: str, shape_name: str, dtype: torch.dtype, cfg: dict, next_weights, synchronize
) -> list[Row]:
    """How long the loop is blocked per update, in the loop and in the background (``background=True``),
    shadows beside the live shards and offloaded (``device="cpu"``): ``update()`` itself plus what
    collecting it waits beyond ``work_ms`` of the loop's own work in between (a stand-in for the
    forward and backward; the optimizer step that follows collects it, here ``wait()``). The
    averages are checked bitwise against the loop's. On a CPU the background shares the cores the
    work runs on."""
    variants = [(device, background) for device in (None, "cpu") for background in (False, True)]
    averages = [WeightAverager(wrapped.model, EMA(decay=cfg["decay"]), device=d, background=b) for d, b in variants]
    work = busy_work(cfg["work_ms"] / 1e3, next(iter(wrapped.local_shards())).device)
    kept: list[list[float]] = [[] for _ in variants]
    for index in range(cfg["warmup"] + cfg["repeats"]):
        next_weights()
        for average, times in zip(averages, kept):
            synchronize()
            dist.barrier()
            began = time.perf_counter()
            average.update()
            returned = time.perf_counter()
            work()
            synchronize()
            collecting = time.perf_counter()
            average.wait()
            synchronize()
            blocked = torch.tensor(returned - began + time.perf_counter() - collecting, dtype=torch.float64)
            dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
            if index >= cfg["warmup"]:
                times.append(blocked.item() * 1e3)
    reference = averages[0].full_state_dict()
    rows = []
    for (device, background), average, times in zip(variants, averages, kept):
        name = ("background" if background else "in the loop") + (", shadows on cpu" if device else "")
        check = compare(average.full_state_dict(), reference, torch.float32, "FAIL") if background else "-"
        timing = sorted(times)
        rows.append(
            Row(kind, shape_name, str(dtype)[6:], f"blocked: {name}", "blocked", statistics.median(timing),
                timing[min(len(timing) - 1, int(0.9 * len(timing)))], 0, average.shadow_bytes(), check)
        )  # fmt: skip
    return rows


def busy_work(seconds: float, device: torch.device) -> Callable[[], None]:
    """``seconds`` of matrix products on ``device``: the loop's own work between two updates."""
    a = torch.randn(256, 256, device=device)

    def work() -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            a.copy_(torch.tanh(a @ a * 1e-2))
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    return work


def export_rows(wrapped: engines.Wrapped, kind: str, shape_name: str, dtype: torch.dtype, cfg: dict) -> list[Row]:
    """The consolidated average (ours) against the engine's own full state dict + a safetensors save."""
    from safetensors.torch import save_file

    average = WeightAverager(wrapped.model, EMA(decay=cfg["decay"]))
    average.update()

    def theirs(directory: Path) -> None:
        if kind == "ddp":
            state = {n: t.detach().clone() for n, t in wrapped.module.state_dict().items()}
        elif kind == "zero3":
            state = wrapped.deepspeed_engine._zero3_consolidated_16bit_state_dict()
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # cpu_offload=True breaks FSDP1's unshard when the parameters already live on the CPU
            # (torch 2.13: "setStorage ... out of bounds for storage of size 0"); on CPU it is a no-op anyway
            offload = next(wrapped.module.parameters()).device.type != "cpu"
            options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
            state = get_model_state_dict(wrapped.model, options=options)
        if dist.get_rank() == 0:
            save_file({n: t.contiguous() for n, t in state.items()}, str(directory / "model.safetensors"))

    label = {"ddp": "state_dict()", "zero3": "_zero3_consolidated_16bit_state_dict()"}.get(
        kind, "get_model_state_dict(full_state_dict)"
    )
    rows = []
    scratch_of_rank0 = [tempfile.mkdtemp(prefix="bench-export-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scratch_of_rank0, src=0)  # (every rank writes part of our export: one folder)
    with contextlib.ExitStack() as cleanup:
        scratch = scratch_of_rank0[0]
        if dist.get_rank() == 0:
            cleanup.callback(shutil.rmtree, scratch, True)
        for name, export in (("export: ours", lambda d: average.export(d)), (f"export: {label} + save_file", theirs)):
            directory = Path(scratch) / name.replace(" ", "_").replace(":", "")
            directory.mkdir(exist_ok=True)
            dist.barrier()
            start = time.perf_counter()
            peak = allocated_peak(lambda export=export, directory=directory: export(directory))
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            peak_rank0 = torch.tensor(peak)
            dist.broadcast(peak_rank0, src=0)
            rows.append(
                Row(
                    kind,
                    shape_name,
                    str(dtype)[6:],
                    name,
                    "export",
                    elapsed.item() * 1e3,
                    elapsed.item() * 1e3,
                    0,
                    int(peak_rank0),
                    "rank-0 peak",
                )
            )
    return rows


# ----------------------------------------------------------------------------- report


def table(rows: list[Row], bandwidth: float, world: int, device: torch.device) -> str:
    """Markdown: times, ratios to the floor and of the peer to ours, achieved GB/s, bytes."""
    floor_ms = {(r.engine, r.shape, r.dtype): r.ms_median for r in rows if r.method == "floor"}
    ours_ms = {(r.engine, r.shape, r.dtype): r.ms_median for r in rows if r.method == "ours"}
    lines = [
        f"copy bandwidth on {device.type} with {world} ranks streaming: {bandwidth / 1e9:.1f} GB/s per rank",
        "",
        "| engine | shape | live | method | ms median | ms p90 | x floor | peer / ours | GB/s | MB recv / update "
        "| extra MiB / rank | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        key = (r.engine, r.shape, r.dtype)
        update = r.role not in ("export", "blocked")
        x_floor = f"{r.ms_median / floor_ms[key]:.2f}" if update and key in floor_ms else ""
        is_peer = update and r.role in ("reference", "peer")
        peer = f"{r.ms_median / ours_ms[key]:.1f}" if is_peer and key in ours_ms else ""
        extra = f"{r.extra_bytes_per_rank / 2**20:.1f}"
        rate = f"{r.gb_per_s:.1f}" if r.gb_per_s else ""
        lines.append(
            f"| {r.engine} | {r.shape} | {r.dtype} | {r.method} | {r.ms_median:.2f} | {r.ms_p90:.2f} | {x_floor} | "
            f"{peer} | {rate} | {r.comm_bytes_per_update / 1e6:.1f} | {extra} | {r.check} |"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Markdown, one line per engine, shape and live dtype: ours against the floor and the gathering peer."""
    lines = [
        "| engine | shape | live | ours / floor | check off / floor | peer / ours | MB recv / update, ours : peer "
        "| extra MiB / rank, ours : peer | export ms, ours : torch | export rank-0 peak MiB, ours : torch "
        "| 3 averages, one averager / three | GB/s, ours : copy floor | ms blocked, loop : background "
        "(shadows on cpu) | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = dict.fromkeys((r.engine, r.shape, r.dtype) for r in rows)
    for case in cases:
        by_role: dict[str, list[Row]] = {}
        for r in rows:
            if (r.engine, r.shape, r.dtype) == case:
                by_role.setdefault(r.role, []).append(r)
        ours, off = by_role["ours"]
        (floor_row,), (peer,) = by_role["floor"], by_role["reference"]
        peer = next((r for r in by_role.get("peer", [])), peer)  # DDP: the AveragedModel replica
        exports = by_role.get("export", [])
        export_ms = " : ".join(f"{r.ms_median:.0f}" for r in exports) or "-"
        export_mib = " : ".join(f"{r.extra_bytes_per_rank / 2**20:.1f}" for r in exports) or "-"
        one, three = by_role["several"]
        rates = f"{ours.gb_per_s:.1f} : {by_role['copy'][0].gb_per_s:.1f}" if "copy" in by_role else "-"
        blocked = by_role.get("blocked", [])
        waits = f"{blocked[0].ms_median:.2f} : {blocked[1].ms_median:.2f} ({blocked[2].ms_median:.2f} : " \
            f"{blocked[3].ms_median:.2f})" if blocked else "-"  # fmt: skip
        lines.append(
            f"| {' | '.join(case)} | {ours.ms_median / floor_row.ms_median:.2f} | "
            f"{off.ms_median / floor_row.ms_median:.2f} | {peer.ms_median / ours.ms_median:.1f} | "
            f"{ours.comm_bytes_per_update / 1e6:.1f} : {peer.comm_bytes_per_update / 1e6:.1f} | "
            f"{ours.extra_bytes_per_rank / 2**20:.1f} : {peer.extra_bytes_per_rank / 2**20:.1f} | "
            f"{export_ms} | {export_mib} | {one.ms_median / three.ms_median:.2f} | {rates} | {waits} | {ours.check} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/bench.yaml")
    parser.add_argument("--json", help="write one record per row here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args()
    cfg = configs.load(args.config, args.set)
    known = ("ddp", "fsdp1", "fsdp2", "zero3", "fsdp2_tp")
    unknown = [e for e in cfg["engines"] if e not in known]
    if unknown:
        raise configs.ConfigError(f"engines: unknown {unknown}; expected some of {', '.join(known)}")
    device = engines.init_distributed("zero3" if "zero3" in cfg["engines"] else "ddp", cfg["device"])
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    cases = [
        (kind, name, shape, getattr(torch, dtype))
        for name, shape in cfg["shapes"].items()
        for dtype in cfg["dtypes"]
        for kind in cfg["engines"]
        if kind != "fsdp2_tp" or shape["kind"] == "transformer"  # (tensor parallel needs the transformer's layers)
    ]
    from tqdm import tqdm

    rows: list[Row] = []
    for kind, name, shape, dtype in tqdm(cases, disable=rank != 0, desc="bench", file=sys.stderr):
        rows.extend(run_case(kind, name, shape, dtype, cfg, device))
    bandwidth = copy_bandwidth(device=device)
    if rank == 0:
        log.info("%s\n\n%s", table(rows, bandwidth, world, device), summary(rows))
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
