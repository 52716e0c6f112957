"""Export and merge against the storage's own speed, on one model of ``--gb`` GB, at 1, 2 and 4 ranks.

    python -m tools.io_bench --dir /tmp/io-bench [--gb 1.0] [--ranks 1 2 4]

For each world size W it launches torchrun with W processes, which shard an fp32 model of
``--gb`` GB with FSDP2, keep an EMA of it, and time, each step with the ranks aligned:

- the floor: every rank writes 1/W of the model's bytes to a file of its own in the folder and
  syncs it (the disk's rate in that folder for W writers);
- ``export(writers=1)``: the single writer (rank 0 receives and writes everything);
- ``export()``: every rank writes about 1/W of the files' bytes;
- torch's ``HuggingFaceStorageWriter`` (``save_distributed``, ``enable_consolidation``) saving
  the model's state dict through DCP, consolidated into the same Hugging Face layout;
- ``shardavg merge`` of two such exports across W writers (``torchrun -m shardavg merge``).

Each row gives the median of ``--repeats`` runs (the methods taking turns) of the seconds on
the slowest rank, GB/s of model bytes, and the most resident memory a rank added (Linux:
``VmHWM`` after a reset). Written to stdout as a markdown table and,
with ``--json``, one record per row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

TENSOR_MB = 16  # each parameter: 4M fp32 values


def resident(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key + ":"))


def measured(step) -> tuple[float, int]:
    """(seconds on the slowest rank, the most resident memory any rank added) of ``step()``."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = resident("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    both = torch.tensor([time.perf_counter() - start, resident("VmHWM") - before], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), int(both[1])


def child(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard

    import shardavg

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    count = max(1, round(args.gb * 1e9 / (TENSOR_MB * 2**20)))
    model = nn.ParameterList(nn.Parameter(torch.randn(TENSOR_MB * 2**18)) for _ in range(count))
    model_bytes = count * TENSOR_MB * 2**20
    fully_shard(model)
    avg = shardavg.WeightAverager(model, shardavg.EMA(decay=0.99))
    avg.update()
    root = Path(args.dir) / f"w{world}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()

    share = torch.ones(model_bytes // 4 // world)  # (made before the clock starts, touched once)

    def floor() -> None:
        with open(root / f"floor-{rank}.bin", "wb") as handle:
            handle.write(memoryview(share.numpy()))
            handle.flush()
            os.fsync(handle.fileno())

    def dcp_hf() -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        writer = HuggingFaceStorageWriter(str(root / "dcp-hf"), save_distributed=True, enable_consolidation=True)
        dcp.save(model.state_dict(), storage_writer=writer)

    rows = [
        ("floor: every rank writes 1/W, synced", floor),
        ("export(writers=1)", lambda: avg.export(root / "one", max_shard_size=args.shard, writers=1)),
        ("export() (every rank writes)", lambda: avg.export(root / "every", max_shard_size=args.shard)),
        ("DCP HuggingFaceStorageWriter + consolidation", dcp_hf),
    ]
    times: dict[str, list[float]] = {label: [] for label, _ in rows}
    peaks: dict[str, int] = dict.fromkeys(times, 0)
    for _ in range(args.repeats):  # the methods take turns, so a drift of the disk's speed falls on all alike
        for label, step in rows:
            seconds, peak = measured(step)
            times[label].append(seconds)
            peaks[label] = max(peaks[label], peak)
    if rank == 0:
        for label, seconds in times.items():
            row = {"method": label, "world": world, "seconds": statistics.median(seconds), "all_seconds": seconds}
            print("ROW " + json.dumps(row | {"peak_bytes": peaks[label], "model_bytes": model_bytes}), flush=True)
    if rank == 0:  # every export equals the single writer's, byte for byte
        for name in sorted(p.name for p in (root / "one").glob("model*")):
            assert (root / "one" / name).read_bytes() == (root / "every" / name).read_bytes(), name
    dist.barrier()
    dist.destroy_process_group()


def merge_child(args: argparse.Namespace) -> None:
    """One writer of ``torchrun -m shardavg merge``, timed like the others."""
    from shardavg.cli import main as cli

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    inputs = [str(Path(args.dir) / f"w{args.source}" / name) for name in ("one", "every")]
    out = Path(args.dir) / f"merge-w{world}"
    runs = [measured(lambda: cli(["merge", *inputs, "--out", str(out), "--max-shard-size", args.shard]))
            for _ in range(args.repeats)]  # fmt: skip
    seconds, peak = statistics.median(r[0] for r in runs), max(r[1] for r in runs)
    if dist.get_rank() == 0:
        model_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        row = {"method": "merge of 2 exports (torchrun -m shardavg merge)", "world": world, "seconds": seconds}
        print("ROW " + json.dumps(row | {"peak_bytes": peak, "model_bytes": model_bytes}), flush=True)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, world: int, mode: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               __file__, mode, "--dir", args.dir, "--gb", str(args.gb), "--shard", args.shard,
               "--source", str(max(args.ranks)), "--repeats", str(args.repeats)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        raise SystemExit(f"{mode} at {world} ranks failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}")
    return [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("ROW ")]


def table(rows: list[dict]) -> str:
    lines = ["| method | ranks | seconds | GB/s | peak MiB added per rank |", "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["method"], r["world"])):
        rate = r["model_bytes"] / r["seconds"] / 1e9
        lines.append(
            f"| {r['method']} | {r['world']} | {r['seconds']:.2f} | {rate:.2f} | {r['peak_bytes'] / 2**20:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="driver", choices=("driver", "child", "merge"))
    parser.add_argument("--dir", required=True, help="the folder written into (on the storage to measure)")
    parser.add_argument("--gb", type=float, default=1.0, help="model size in GB (fp32)")
    parser.add_argument("--shard", default="200MB", help="max_shard_size of the exports")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--source", type=int, default=4, help="(merge: which world size's exports to merge)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each step (the median is reported)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.mode == "child":
        return child(args)
    if args.mode == "merge":
        return merge_child(args)
    rows = []
    for world in args.ranks:
        rows += launch(args, world, "child")
        print(table(rows), file=sys.stderr)
    for world in args.ranks:
        rows += launch(args, world, "merge")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
