"""Post-hoc EMA (EDM2): snapshot two EMA profiles while training, then pick the EMA length afterwards.

Shows: ``shardavg.PostHocEMA`` beside an FSDP2 training loop (shard-local power-function EMAs,
written as sharded snapshots every few updates); after training, a sweep over ``sigma_rel``
values synthesized from the snapshots (no retraining, no gather), each evaluated under
``swapped()`` on held-out data; the best one exported.

    torchrun --nproc_per_node 2 examples/posthoc_sweep.py --steps 400 --out runs/posthoc

Give each run a fresh ``--out``: snapshots belong to the run that wrote them (another run's are
refused). The snapshots can also be swept offline, in one process: ``shardavg posthoc runs/posthoc/snapshots
--list`` says which sigma_rel values fit, ``shardavg posthoc runs/posthoc/snapshots ema-0.08
--sigma-rel 0.08`` writes one.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import shardavg

SWEEP = (0.03, 0.05, 0.07, 0.10, 0.13, 0.16, 0.20)  # EDM2 found its best between 0.05 and 0.15


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
    """Noisy synthetic regression: the noise is what an average of the weights smooths out."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, dim, generator=generator)
    return x, torch.sin(3 * x.mean(-1, keepdim=True)) + noise * torch.randn(size, 1, generator=generator)


@torch.no_grad()
def evaluate(model: nn.Module, dim: int, device: torch.device) -> float:
    x, y = (t.to(device) for t in batch(-1, dim, size=1024, noise=0.0))
    return nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--snapshot-every", type=int, default=40)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/posthoc"))
    args = parser.parse_args()
    for flag in ("steps", "snapshot_every", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.snapshot_every > args.steps:
        parser.error(f"argument --snapshot-every: {args.snapshot_every} exceeds --steps {args.steps} (no snapshot)")
    if any((args.out / "snapshots").glob("snapshot-*")):
        parser.error(f"argument --out: {args.out / 'snapshots'} holds another run's snapshots; give a fresh --out")

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
    posthoc = shardavg.PostHocEMA(  # shardavg: two power-function EMA profiles, snapshotted every N updates
        model, sigma_rels=(0.05, 0.10), snapshot_every=args.snapshot_every, directory=args.out / "snapshots"
    )

    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batch(1000 * step + rank, args.dim))
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        posthoc.update()  # shardavg: shard-local; a snapshot every snapshot_every updates

    live = evaluate(model, args.dim, device)
    results: dict[float, float] = {}
    for sigma_rel in SWEEP:  # after training: any EMA length, from the snapshots alone
        try:
            average = posthoc.synthesize(sigma_rel=sigma_rel)  # shardavg: collective, each rank its own parts
        except ValueError as refused:  # too far from the profiles for these snapshots (said on every rank)
            if rank == 0:
                print(f"sigma_rel {sigma_rel}: skipped, {str(refused).split(': ')[-1]}")
            continue
        with average.swapped():  # shardavg
            results[sigma_rel] = evaluate(model, args.dim, device)
    best = min(results, key=results.__getitem__)
    posthoc.synthesize(sigma_rel=best).export(args.out / f"ema-{best}")  # shardavg: the chosen one, consolidated
    if rank == 0:
        print(f"live weights: held-out loss {live:.5f}")
        for sigma_rel, loss in results.items():
            print(f"sigma_rel {sigma_rel}: held-out loss {loss:.5f}")
        print(f"best sigma_rel {best} (held-out loss {results[best]:.5f}), exported to {args.out / f'ema-{best}'}")
    dist.barrier()  # every rank done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
