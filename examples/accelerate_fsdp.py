"""accelerate with its FSDP plugin (FSDP2), an EMA kept shard by shard, in ``save_state`` checkpoints.

Shows: the averager on the model ``accelerator.prepare`` returns; updates once per real optimizer
step under gradient accumulation (``accelerator.sync_gradients``); ``attach`` so that
``accelerator.save_state`` writes every rank's shard of the average beside the engine's files;
resuming with ``shardavg.integrations.accelerate.load_state`` (the average checked before the model
moves); evaluation under ``avg.swapped()``; a consolidated export.

    accelerate launch --num_processes 2 examples/accelerate_fsdp.py --steps 200 --out runs/accelerate   # GPUs
    torchrun --nproc_per_node 2 examples/accelerate_fsdp.py --steps 200 --out runs/accelerate             # CPU

On a machine without a GPU accelerate turns the FSDP plugin into DDP (its MULTI_CPU mode): the
averager follows whatever ``prepare`` returns, so the same lines run there. Run it again with the
same ``--out`` and more ``--steps``: it resumes from the newest checkpoint.
"""

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch import nn

import shardavg
from shardavg.integrations.accelerate import attach, load_state


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(layers)))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def batch(seed: int, dim: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(3 * x.mean(-1, keepdim=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (2 micro-batches each)")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/accelerate"))
    args = parser.parse_args()
    for flag in ("steps", "save_every", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")

    if not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # under torchrun on CPU, else accelerate sees 1 process
    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    accelerator = Accelerator(gradient_accumulation_steps=2, fsdp_plugin=fsdp)
    torch.manual_seed(0)
    model = Net(args.dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    avg = shardavg.WeightAverager(model, rule)  # shardavg: on the prepared model
    attach(accelerator, avg)  # shardavg: save_state / load_state now carry the average

    checkpoints = args.out / "checkpoints"  # a checkpoint is whole once its average is (written last)
    done = [p for p in checkpoints.glob("step-*") if (p / "shardavg" / "shardavg.json").is_file()]
    start = 0
    if done:
        newest = max(done, key=lambda p: int(p.name.split("-")[1]))
        load_state(accelerator, newest)  # shardavg: checks the average, then accelerator.load_state
        start = int(newest.name.split("-")[1])
        accelerator.print(f"resumed from {newest} at step {start} (average of {avg.num_updates} updates)")

    rank = accelerator.process_index
    for step in range(start + 1, args.steps + 1):
        for micro in range(2):
            with accelerator.accumulate(model):
                x, y = (t.to(accelerator.device) for t in batch(1000 * step + 10 * micro + rank, args.dim))
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                avg.update(step=step)  # shardavg: once per real optimizer step, shard-local
        if step % args.save_every == 0 or step == args.steps:
            accelerator.save_state(checkpoints / f"step-{step:06d}")  # the engine's files, then the average
            accelerator.print(f"step {step}: train loss {loss.item():.4f}")

    x, y = (t.to(accelerator.device) for t in batch(-1, args.dim, size=256))
    with torch.no_grad():
        live = nn.functional.mse_loss(model(x), y).item()
        with avg.swapped():  # shardavg: the average in the model inside the block
            ema = nn.functional.mse_loss(model(x), y).item()
    avg.export(args.out / "ema")  # shardavg: collective; model.safetensors that Net() loads with strict=True
    accelerator.print(f"{accelerator.distributed_type} with {accelerator.num_processes} processes, {avg.strategy.name}")
    accelerator.print(f"done at step {args.steps}: held-out loss live {live:.4f}, ema {ema:.4f}; exported")
    accelerator.wait_for_everyone()  # every rank done with gloo before any tears it down
    accelerator.end_training()  # (destroys the process group)


if __name__ == "__main__":
    main()
