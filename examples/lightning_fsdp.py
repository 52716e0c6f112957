"""Lightning with FSDP2 (``ModelParallelStrategy``) and shardavg's ``ShardedWeightAveraging`` callback.

Shows: the callback in place of Lightning's own ``EMAWeightAveraging`` (which deep-copies the
module and fails on sharded strategies); validation runs on the averaged weights; every
checkpoint gets the average beside it (``<checkpoint>.shardavg/``), restored by
``trainer.fit(ckpt_path=...)``; a consolidated export of the average at the end.

    torchrun --nproc_per_node 2 examples/lightning_fsdp.py --steps 100 --out runs/lightning

(or ``python examples/lightning_fsdp.py`` on a machine with 2 GPUs: Lightning starts the processes.)
Run it again with the same ``--out`` and more ``--steps``: it resumes from ``last.ckpt``.
"""

import argparse
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

import shardavg
from shardavg.integrations.lightning import ShardedWeightAveraging


class LitNet(L.LightningModule):
    """A residual MLP regressor; ``configure_model`` shards each block and the root with FSDP2."""

    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, 1)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        x, y = batch  # under ShardedWeightAveraging the model holds the average here
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(count: int, seed: int, dim: int) -> torch.utils.data.DataLoader:
    x = torch.randn(count, dim, generator=torch.Generator().manual_seed(seed))
    y = torch.sin(3 * x.mean(-1, keepdim=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2, help="processes (torchrun's --nproc_per_node)")
    parser.add_argument("--out", type=Path, default=Path("runs/lightning"))
    args = parser.parse_args()
    for flag in ("steps", "save_every", "dim", "devices"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if int(os.environ.get("WORLD_SIZE", args.devices)) != args.devices:  # under torchrun: its process count
        parser.error(f"argument --devices: {args.devices}, but torchrun started {os.environ['WORLD_SIZE']}")
    if args.save_every > args.steps:  # the average is validated (val_loss) every --save-every steps
        parser.error(f"argument --save-every: {args.save_every} exceeds --steps {args.steps} (no validation)")

    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    averaging = ShardedWeightAveraging(rule=rule)  # shardavg: or decay=0.999, as Lightning's EMAWeightAveraging
    checkpoints = ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=args.save_every, save_last=True)
    trainer = L.Trainer(
        accelerator="auto",
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        max_steps=args.steps,
        val_check_interval=args.save_every,  # every N steps, across epochs
        check_val_every_n_epoch=None,
        callbacks=[averaging, checkpoints],  # shardavg
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = LitNet(args.dim)
    last = args.out / "checkpoints" / "last.ckpt"
    resume = str(last) if last.exists() else None  # its average (last.ckpt.shardavg/) comes back with it
    trainer.fit(model, data(1024, 1, args.dim), data(128, 2, args.dim), ckpt_path=resume)

    averager = averaging.averager  # shardavg
    averager.export(args.out / "ema")  # shardavg: collective; model.safetensors that LitNet() loads strictly
    if trainer.is_global_zero:
        print(f"val_loss of the average {trainer.callback_metrics['val_loss'].item():.4f}")
        print(f"done at step {trainer.global_step}: {'resumed from ' + resume + ', ' if resume else ''}"
              f"{averager.num_updates} updates, exported to {args.out / 'ema'}")  # fmt: skip
    if dist.is_initialized():  # every rank done with gloo before any tears it down
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
