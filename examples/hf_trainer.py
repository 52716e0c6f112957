"""The Hugging Face Trainer with shardavg's ``WeightAveragingCallback``: an EMA of a small GPT-2.

Shows: ``with_weight_averaging`` (the callback, bound to its Trainer) keeping the average once per
optimizer step, saved into every ``checkpoint-<step>/shardavg/`` and rotated with it, restored by
``trainer.train(resume_from_checkpoint=...)``, evaluated after each evaluation (``eval_avg_loss``
beside ``eval_loss``), and exported at the end with the model's ``config.json``, so that
``GPT2LMHeadModel.from_pretrained`` loads the average. The model is built from a config: no download.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --steps 100 --out runs/hf-trainer

Under torchrun the Trainer runs DDP; with ``fsdp=...`` or ``deepspeed=...`` in ``TrainingArguments``
the same callback keeps the average shard-local. Run it again with the same ``--out`` and more
``--steps``: it resumes from the newest checkpoint, its average included.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import shardavg
from shardavg.integrations.transformers import with_weight_averaging


class Tokens(torch.utils.data.Dataset):
    """Random sequences that repeat their first half: the second half is learnable."""

    def __init__(self, count: int, seed: int, vocab: int, length: int = 16) -> None:
        half = torch.randint(0, vocab, (count, length // 2), generator=torch.Generator().manual_seed(seed))
        self.ids = torch.cat([half, half], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/hf-trainer"))
    args = parser.parse_args()
    for flag in ("steps", "save_every", "dim"):  # counts, checked before anything starts
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.dim % 2:
        parser.error(f"argument --dim: must be even (the model's 2 attention heads split it), got {args.dim}")

    config = GPT2Config(n_layer=2, n_embd=args.dim, n_head=2, vocab_size=128, n_positions=16)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # the average updates once per optimizer step, after accumulation
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=args.save_every,
        save_steps=args.save_every,
        save_total_limit=2,  # older checkpoints are rotated away, their averages with them
        logging_steps=args.save_every,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(512, seed=1, vocab=config.vocab_size),
        eval_dataset=Tokens(64, seed=2, vocab=config.vocab_size),
    )
    rule = shardavg.EMA(decay=0.999, warmup=shardavg.RatioWarmup())  # shardavg: decay min(0.999, (n+1)/(n+10))
    averaging = with_weight_averaging(trainer, rule, export_dir=args.out / "ema")  # shardavg: the callback, bound

    last = get_last_checkpoint(training.output_dir) if Path(training.output_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=last)  # resumed: the average of that checkpoint comes back too

    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:  # the average's evaluation is logged beside the model's
            for key in ("eval_loss", "eval_avg_loss"):
                if key in entry:
                    print(f"step {entry['step']}: {key} {entry[key]:.4f}")
        resumed = f"resumed from {last}, " if last else ""
        updates = averaging.averager.num_updates  # shardavg: the callback's WeightAverager
        print(f"done at step {trainer.state.global_step}: {resumed}{updates} updates, exported to {args.out / 'ema'}")
    if dist.is_initialized():  # under torchrun: every rank done with gloo before any tears it down
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
