"""FSDP2 x tensor parallel on a 2-D DeviceMesh, with an EMA kept on each rank's piece of each weight.

Shows: ``parallelize_module`` (column-wise in, row-wise out) over the ``tp`` mesh dim, then
``fully_shard`` over ``dp`` (torchtitan's recipe); the averager takes the model as it is, whatever
the DTensor placements; evaluation under ``avg.swapped()``; a consolidated export the plain model loads.

    torchrun --nproc_per_node 4 examples/fsdp2_tp.py --tp 2 --steps 100 --out runs/fsdp2-tp   # 2 (dp) x 2 (tp)

``--tp`` ranks share each weight, the rest of the world is data parallel: at 2 processes
``--tp 2`` is a 1 x 2 mesh (tensor parallel only), ``--tp 1`` a 2 x 1 one (FSDP2 only).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardavg


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """A token classifier: embedding, residual MLP blocks, head (each token on its own: no attention)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(seed: int, vocab: int = 64, size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tokens whose label is the next token id: a rule the model can learn."""
    tokens = torch.randint(0, vocab, (size,), generator=torch.Generator().manual_seed(seed))
    return tokens, (tokens + 1) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; the world divided by it is dp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/fsdp2-tp"))
    args = parser.parse_args()
    for flag in ("tp", "steps", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, known before the process group
    if world % args.tp:
        parser.error(f"argument --tp: {args.tp} does not divide the {world} process(es) (torchrun's --nproc_per_node)")

    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL on GPUs, gloo on CPU
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    mesh = init_device_mesh(device_type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net(dim=args.dim).to(device_type)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    avg = shardavg.WeightAverager(model, rule)  # shardavg: every rank, after sharding

    dp_rank = mesh["dp"].get_local_rank()  # the ranks of one tp group train on the same batch
    for step in range(1, args.steps + 1):
        tokens, targets = (t.to(device_type) for t in batch(1000 * step + dp_rank))
        loss = nn.functional.cross_entropy(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        avg.update()  # shardavg: each rank's piece of each weight, no communication

    tokens, targets = (t.to(device_type) for t in batch(-1))
    with torch.no_grad():
        live = nn.functional.cross_entropy(model(tokens), targets).item()
        with avg.swapped():  # shardavg: the average in the model, each rank its own pieces
            ema = nn.functional.cross_entropy(model(tokens), targets).item()
    avg.export(args.out / "ema")  # shardavg: collective; the whole model, loadable by Net() with strict=True
    if dist.get_rank() == 0:
        placements = {str(p.placements) for p in model.parameters()}
        print(f"mesh {tuple(mesh.shape)} (dp, tp), placements {sorted(placements)}")
        print(f"held-out loss live {live:.4f}, ema {ema:.4f}")
        print(f"done at step {args.steps}: exported to {args.out / 'ema'}")
    dist.barrier()  # every rank done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
