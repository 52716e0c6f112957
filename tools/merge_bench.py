"""``shardavg merge`` of Megatron-Core ``torch_dist`` checkpoints against the storage's floor, at 1, 2 and 4 writers.

    python -m tools.merge_bench --dir /tmp/merge-bench [--inputs 8] [--gb 0.25] [--writers 1 2 4]

Writes ``--inputs`` checkpoints laid out as Megatron-Core's ``dist_checkpointing.save`` with the
``torch_dist`` backend writes them (flat keys, layer stacks ``[L, ...]``, its ``metadata.json``,
its ranks' save plans in DCP's ``.metadata``), each of ``--gb`` GB of fp32 model tensors, then
times for each writer count W, the steps taking turns ``--repeats`` times (the median reported):

- the floor: W processes together read every input file once and write the output's bytes once
  (each 1/W of both, its file synced): what any merge must move;
- ``shardavg.merge(IN..., OUT, collective=True)`` in each of W writers launched by torchrun
  (what ``torchrun -m shardavg merge`` runs), timed between barriers, the launch not counted.

The inputs were just written, so both read from the page cache where it holds them: the same
for both. Prints a markdown table (GB/s of input bytes read) and, with ``--json``, the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from multiprocessing import Process
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

LAYERS = 8
CHUNK = 2**24  # bytes a floor process reads or writes at once


def megatron_checkpoint(folder: Path, gb: float, seed: int) -> None:
    """One ``torch_dist`` checkpoint of ``gb`` GB of fp32 tensors, keyed as Megatron-Core keys them."""
    from torch.distributed.checkpoint.planner import SavePlan

    width = int((gb * 1e9 / 4 / LAYERS / 4) ** 0.5)  # four stacked [L, width, width] tensors
    g = torch.Generator().manual_seed(seed)
    names = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    state = {f"decoder.layers.{n}.weight": torch.randn(LAYERS, width, width, generator=g) for n in names}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    with open(folder / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # (written just now, by this process)
    metadata.planner_data, metadata.all_local_plans = {}, [SavePlan([], planner_data={})]
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))


def floor_part(files: list[Path], rank: int, world: int, out: Path, out_bytes: int) -> None:
    """This process's 1/W of reading every input byte once and writing the output's bytes once."""
    total = sum(f.stat().st_size for f in files)
    start, stop = total * rank // world, total * (rank + 1) // world
    base = 0
    for file in files:
        size = file.stat().st_size
        low, high = max(start, base), min(stop, base + size)
        if high > low:
            with open(file, "rb", buffering=0) as handle:
                handle.seek(low - base)
                left = high - low
                while left:
                    left -= len(handle.read(min(CHUNK, left)))
        base += size
    block = bytes(CHUNK)
    with open(out / f"part-{rank}", "wb", buffering=0) as handle:
        left = out_bytes * (rank + 1) // world - out_bytes * rank // world
        while left:
            left -= handle.write(block[: min(CHUNK, left)])
        os.fsync(handle.fileno())


def floor(files: list[Path], world: int, out: Path, out_bytes: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    processes = [Process(target=floor_part, args=(files, r, world, out, out_bytes)) for r in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return time.perf_counter() - started


def merge_child(args: argparse.Namespace) -> None:
    """One writer of a merge split over the launch's writers, timed between barriers ``--repeats`` times."""
    import torch.distributed as dist

    import shardavg

    dist.init_process_group("gloo")
    inputs, out = [Path(p) for p in args.merge_inputs], Path(args.dir) / "merged"
    seconds = []
    for _ in range(args.repeats):
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
        dist.barrier()
        started = time.perf_counter()
        shardavg.merge(inputs, out, collective=True)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print("SECONDS " + json.dumps(seconds), flush=True)
    dist.destroy_process_group()


def merge(args: argparse.Namespace, inputs: list[Path], world: int) -> list[float]:
    """The seconds of each of ``--repeats`` merges at ``world`` writers (the launch not counted)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "tools.merge_bench", "--dir", args.dir, "--repeats", str(args.repeats),
               "--merge-inputs", *map(str, inputs)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        raise SystemExit(f"merge at {world} writers failed:\n{result.stderr[-5000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("SECONDS "))
    return json.loads(line.removeprefix("SECONDS "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="the folder written into (on the storage to measure)")
    parser.add_argument("--inputs", type=int, default=8, help="checkpoints merged")
    parser.add_argument("--gb", type=float, default=0.25, help="each checkpoint's size in GB")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--merge-inputs", nargs="+", help="(a merge writer: the checkpoints to merge)")
    args = parser.parse_args()
    if args.merge_inputs:
        return merge_child(args)
    root = Path(args.dir)
    inputs = [root / f"iter_{i:07d}" for i in range(args.inputs)]
    for seed, folder in enumerate(inputs):
        if not (folder / ".metadata").is_file():
            megatron_checkpoint(folder, args.gb, seed)
    files = sorted(p for folder in inputs for p in folder.iterdir() if p.suffix == ".distcp")
    read = sum(f.stat().st_size for f in files)
    written = read // args.inputs
    rows = []
    for world in args.writers:
        times = {
            "floor: read every input once, write the output once": [
                floor(files, world, root / "floor", written) for _ in range(args.repeats)
            ],
            f"shardavg merge of {args.inputs} torch_dist checkpoints": merge(args, inputs, world),
        }
        for method, seconds in times.items():
            median = statistics.median(seconds)
            rows.append({"method": method, "writers": world, "seconds": median, "read_bytes": read, "all": seconds})
    lines = ["| method | writers | seconds | GB/s read |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['writers']} | {r['seconds']:.2f} | {r['read_bytes'] / r['seconds'] / 1e9:.2f} |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
