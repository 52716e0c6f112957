"""One rank of a W-rank FSDP2 job, simulated on one machine, and what building and saving the
averager cost it, as counts (one JSON line on stdout).

    python tests/simulated_rank.py --world 4096 --layers 64 --out /tmp/ckpt

PyTorch's fake process group (the one it uses to estimate FSDP2 at scale) plays rank 0 of
``--world``: collectives return without data, so the library may only derive other ranks'
parts, never gather them. The model is built on the meta device, ``fully_shard``-ed per layer
and materialised with ``to_empty``. Reported: the objects the all-gathers carried (pickled
bytes), Python memory traced while the averager was built, the distinct layouts it reasoned
about, and the manifest ``save`` wrote (its bytes, grids, and whether any tensor lists chunks).
"""

from __future__ import annotations

import argparse
import json
import pickle
import tracemalloc
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


class Layer(nn.Module):
    """A transformer layer's tensors, a dozen shapes among them, none divisible by every world size."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim + 1), nn.Linear(4 * dim + 1, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardavg
    from shardavg.layouts import tensor_layout

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    gathered: list[int] = []
    all_gather_object = dist.all_gather_object

    def counted(outputs, value, group=None):  # what each all-gather carries, as the real one would pickle it
        gathered.append(len(pickle.dumps(value)))
        return all_gather_object(outputs, value, group=group)

    dist.all_gather_object = counted
    mesh = init_device_mesh("cpu", (args.world,))
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(1000, args.dim), *(Layer(args.dim) for _ in range(args.layers)))
    for layer in model[1:]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_()

    tracemalloc.start()
    averager = shardavg.WeightAverager(model, shardavg.EMA(0.999))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    construction = list(gathered)
    averager.update()
    path = averager.save(args.out)
    manifest = json.loads((path / "shardavg.json").read_text())
    print(
        json.dumps(
            {
                "world": args.world,
                "tensors": len(averager.layout.layouts),
                "gathered_tensors": len(averager.layout.gathered),
                "construction_gathers": construction,
                "construction_traced_peak": peak,
                "distinct_mesh_layouts": tensor_layout._owners.cache_info().currsize,
                "manifest_bytes": (path / "shardavg.json").stat().st_size,
                "manifest_tensors": len(manifest["tensors"]),
                "manifest_grids": len(manifest["grids"]),
                "manifest_chunk_tables": sum("chunks" in entry for entry in manifest["tensors"]),
                "files": manifest["files"],
            }
        )
    )


if __name__ == "__main__":
    main()
