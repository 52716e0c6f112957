"""What describing the averager costs on disk: DCP's ``.metadata`` against ``avg.save``'s manifest.

    torchrun --nproc_per_node 2 -m tools.dcp_metadata --layers 60
    torchrun --nproc_per_node 4 -m tools.dcp_metadata --layers 60

An FSDP2 model and its averager are saved together with ``dcp.save`` and the averager alone with
``avg.save``. DCP's metadata lists every chunk of every tensor (tensors x ranks under FSDP2):
printed are the bytes of its entries for the model's state dict and for the averager (each
entry's tensor and storage records, pickled as DCP writes them), the chunks they list, and the
bytes of the averager's format-6 manifest, which lists each tensor's layout once. Rank 0 prints
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardavg


def entry_bytes(metadata, prefix: str) -> tuple[int, int]:
    """Pickled bytes of the metadata's records under ``prefix``, and the chunks they list."""
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    storage = {k: v for k, v in metadata.storage_data.items() if k.fqn.startswith(prefix)}
    chunks = sum(len(getattr(value, "chunks", ())) for value in tensors.values())
    return len(pickle.dumps(tensors)) + len(pickle.dumps(storage)), chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=60, help="blocks of (LayerNorm, Linear, Linear): 6 tensors each")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 192), nn.Linear(192, 64)) for _ in range(args.layers)]
    model = nn.Sequential(*blocks)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    averager = shardavg.WeightAverager(model, shardavg.EMA(0.99))
    averager.update()
    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    folder = Path(root[0])
    dcp.save({"model": get_model_state_dict(model), "ema": averager}, checkpoint_id=folder / "dcp")
    saved = averager.save(folder / "saved")
    if dist.get_rank() == 0:
        metadata = dcp.FileSystemReader(folder / "dcp").read_metadata()
        model_bytes, model_chunks = entry_bytes(metadata, "model.")
        ema_bytes, ema_chunks = entry_bytes(metadata, "ema.")
        report = {
            "world_size": dist.get_world_size(),
            "tensors": len(averager.layout.layouts),
            "dcp_metadata_file": (folder / "dcp" / ".metadata").stat().st_size,
            "dcp_model_entry": model_bytes,
            "dcp_model_chunks": model_chunks,
            "dcp_averager_entry": ema_bytes,
            "dcp_averager_chunks": ema_chunks,
            "manifest": (saved / "shardavg.json").stat().st_size,
        }
        print(json.dumps(report))
        shutil.rmtree(folder)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
