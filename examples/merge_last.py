"""Merge the last few checkpoints of a run (LAWA): ``shardavg.merge(..., last=N)`` after training.

Shows: an FSDP2 loop writing ``torch.distributed.checkpoint`` checkpoints (model and optimizer)
and keeping the newest ``--keep``; then the uniform average of the newest ``--last`` of them,
merged by every rank together (``collective=True``: each reads and writes its share), written as
an averager checkpoint that an averager on the sharded model loads at any world size; evaluated
under ``swapped()`` against the live weights, and exported as a consolidated model.

    torchrun --nproc_per_node 2 examples/merge_last.py --steps 200 --out runs/merge

The same merge from the shell, in one process, into a model folder:
``shardavg merge --last 4 runs/merge/checkpoints --out runs/merge/lawa``.
"""

import argparse
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

import shardavg


class Net(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def batch(seed: int, dim: int, size: int = 64, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, dim, generator=generator)
    return x, torch.sin(3 * x.mean(-1, keepdim=True)) + noise * torch.randn(size, 1, generator=generator)


@torch.no_grad()
def evaluate(model: nn.Module, dim: int, device: torch.device) -> float:
    x, y = (t.to(device) for t in batch(-1, dim, size=1024, noise=0.0))
    return nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--keep", type=int, default=5, help="checkpoints kept on disk")
    parser.add_argument("--last", type=int, default=4, help="checkpoints merged")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/merge"))
    args = parser.parse_args()
    for flag in ("steps", "save_every", "keep", "last", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    kept = min(args.keep, args.steps // args.save_every)  # the checkpoints on disk when training ends
    if args.last > kept:
        kept_by = f"--steps {args.steps} // --save-every {args.save_every}, at most --keep {args.keep}"
        parser.error(f"argument --last: {args.last} is more than the {kept} checkpoint(s) the run keeps ({kept_by})")

    cuda = torch.cuda.is_available()  # one process per GPU with NCCL; on CPU, gloo
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = Net(args.dim).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    checkpoints = args.out / "checkpoints"
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batch(1000 * step + rank, args.dim))
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.save_every == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoints / f"step-{step:06d}")
            if rank == 0:  # keep the newest --keep
                for old in sorted(checkpoints.glob("step-*"))[: -args.keep]:
                    shutil.rmtree(old)
            dist.barrier()

    # Every rank takes part: the inputs are opened and checked by all, the tensors split between them.
    # The model's entry of each DCP checkpoint is merged, never the optimizer's.
    merged = shardavg.merge(  # shardavg
        checkpoints, args.out / "lawa", last=args.last, output="shardavg", collective=True
    )
    lawa = shardavg.WeightAverager(model, shardavg.SWA())  # shardavg: holds the merge, shard by shard
    lawa.load(merged)  # shardavg: at this world size, whatever the merge's
    live = evaluate(model, args.dim, device)
    with lawa.swapped():  # shardavg
        merged_loss = evaluate(model, args.dim, device)
    lawa.export(args.out / "lawa-model")  # shardavg: consolidated safetensors that Net() loads with strict=True
    if rank == 0:
        kept = sorted(p.name for p in checkpoints.glob("step-*"))
        print(f"kept {kept}; merged the last {args.last} into {merged}")
        print(f"held-out loss live {live:.5f}, merge of the last {args.last} {merged_loss:.5f}")
    dist.barrier()  # every rank done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
