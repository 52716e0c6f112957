"""FSDP2 (``fully_shard``) training with an EMA kept shard by shard, in plain PyTorch.

Shows: the averager beside a plain training loop; the model, the optimizer and the average in one
``torch.distributed.checkpoint`` save (the averager is a DCP ``Stateful``); resuming from the
newest checkpoint; evaluation with the averaged weights under ``avg.swapped()``; a consolidated
safetensors export of the average that the plain, unwrapped model loads.

    torchrun --nproc_per_node 2 examples/fsdp2_dcp.py --steps 200 --out runs/fsdp2-dcp

Run it again with the same ``--out`` and more ``--steps``: it resumes from the newest checkpoint.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import shardavg


class Net(nn.Module):
    """A small residual MLP: enough blocks to shard, small enough for a CPU."""

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


def batch(seed: int, dim: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, a function of ``seed`` only (so a resumed run sees the same batches)."""
    x = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(3 * x.mean(-1, keepdim=True))


def newest_checkpoint(root: Path) -> Path | None:
    """The newest finished checkpoint: DCP writes ``.metadata`` last, so a folder without it is half-written."""
    done = [p for p in root.glob("step-*") if (p / ".metadata").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


@torch.no_grad()
def evaluate(model: nn.Module, dim: int, device: torch.device) -> float:
    """Loss on held-out data (collective under FSDP2: every rank runs it on the same batch)."""
    x, y = (t.to(device) for t in batch(-1, dim, size=256))
    return nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/fsdp2-dcp"))
    args = parser.parse_args()
    for flag in ("steps", "save_every", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")

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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    avg = shardavg.WeightAverager(model, rule)  # shardavg: every rank, after fully_shard

    start = 0
    checkpoint = newest_checkpoint(args.out / "checkpoints")
    if checkpoint is not None:  # resume: the model, the optimizer and the average from one checkpoint
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "ema": avg}  # shardavg: the averager is a Stateful
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(checkpoint.name.split("-")[1])
        if rank == 0:
            print(f"resumed from {checkpoint} at step {start} (average of {avg.num_updates} updates)")  # shardavg

    for step in range(start + 1, args.steps + 1):
        x, y = (t.to(device) for t in batch(1000 * step + rank, args.dim))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        avg.update(step=step)  # shardavg: this rank's shards, in place, no communication
        if step % args.save_every == 0 or step == args.steps:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "ema": avg}  # shardavg: saved beside the model
            dcp.save(state, checkpoint_id=args.out / "checkpoints" / f"step-{step:06d}")
            live = evaluate(model, args.dim, device)
            with avg.swapped():  # shardavg: the model holds the average inside the block
                ema = evaluate(model, args.dim, device)
            if rank == 0:
                print(f"step {step}: train loss {loss.item():.4f}, held-out loss live {live:.4f}, ema {ema:.4f}")

    avg.export(args.out / "ema")  # shardavg: collective; model.safetensors that Net() loads with strict=True
    if rank == 0:
        print(f"done at step {args.steps}: {avg.num_updates} updates, exported to {args.out / 'ema'}")
    dist.barrier()  # every rank done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
