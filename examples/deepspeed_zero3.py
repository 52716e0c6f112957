"""DeepSpeed ZeRO-3 with an EMA kept on each rank's partition, inside DeepSpeed's own checkpoints.

Shows: a model built partitioned (``deepspeed.zero.Init``), the averager on the engine,
``shardavg.integrations.deepspeed.save_checkpoint`` / ``load_checkpoint`` (the engine's files, the
average beside them in ``<tag>/shardavg/``, then ``latest``), resuming from ``latest``, evaluation
under ``avg.swapped()`` and a consolidated export the plain model loads.

    torchrun --nproc_per_node 2 examples/deepspeed_zero3.py --steps 200 --out runs/zero3

(DeepSpeed reads torchrun's environment; its own ``deepspeed`` launcher works too.) Run it again
with the same ``--out`` and more ``--steps``: it resumes from the checkpoint ``latest`` names.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: its CPU accelerator, gloo
import deepspeed  # noqa: E402

import shardavg  # noqa: E402
from shardavg.integrations.deepspeed import load_checkpoint, save_checkpoint  # noqa: E402


class Net(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.GELU())
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def batch(seed: int, dim: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(3 * x.mean(-1, keepdim=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/zero3"))
    args = parser.parse_args()
    for flag in ("steps", "save_every", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # 0: partition every parameter (the default, 1e5 elements, would keep this small model whole)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        # fp32 weights on every machine: with bf16 on, pass source="master" to the averager to average
        # the optimizer's fp32 masters rather than the bf16 weights
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    torch.manual_seed(0)
    # No dtype= here: zero.Init(dtype=torch.float32) partitions in bf16 on CPUs without oneDNN fp16
    # (DeepSpeed 0.19); from the config (bf16 and fp16 off) it picks fp32 everywhere.
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Net(args.dim)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    avg = shardavg.WeightAverager(engine, rule)  # shardavg: on the engine, every rank

    checkpoints = args.out / "checkpoints"
    if (checkpoints / "latest").is_file():
        load_checkpoint(engine, avg, checkpoints)  # shardavg: the engine and the average of the same tag
        if engine.global_rank == 0:
            print(f"resumed at step {engine.global_steps} (average of {avg.num_updates} updates)")

    rank, device = engine.global_rank, engine.device
    for step in range(engine.global_steps + 1, args.steps + 1):
        x, y = (t.to(device) for t in batch(1000 * step + rank, args.dim))
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        avg.update()  # shardavg: this rank's partitions (ds_tensor), in place, no communication
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(engine, avg, checkpoints)  # shardavg: instead of engine.save_checkpoint(...)
            if rank == 0:
                print(f"step {step}: train loss {loss.item():.4f}, saved {checkpoints / f'global_step{step}'}")

    x, y = (t.to(device) for t in batch(-1, args.dim, size=256))
    with torch.no_grad():
        live = nn.functional.mse_loss(engine(x), y).item()
        with avg.swapped():  # shardavg: the engine holds the average inside the block
            ema = nn.functional.mse_loss(engine(x), y).item()
    avg.export(args.out / "ema")  # shardavg: collective; model.safetensors that Net() loads with strict=True
    if rank == 0:
        dtypes = sorted({str(p.ds_tensor.dtype) for p in engine.module.parameters()})
        print(f"partitions held in {dtypes}; held-out loss live {live:.4f}, ema {ema:.4f}")
        print(f"done at step {engine.global_steps}: {avg.num_updates} updates, exported to {args.out / 'ema'}")
    dist.barrier()  # every rank done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
