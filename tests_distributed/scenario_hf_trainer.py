"""torchrun scenarios for ``shardavg.integrations.transformers`` with a tiny random GPT-2 on CPU.

    torchrun --standalone --nproc_per_node 2 tests_distributed/scenario_hf_trainer.py MODE KIND ROOT

KIND is ``ddp`` or ``deepspeed`` (ZeRO-3). Training: 8 optimizer steps of 2 accumulated
micro-batches, checkpoints at steps 3, 6 and 8 with ``save_total_limit=2``, evaluation at 4 and 8
(under DDP: accelerate gathers eval losses under DeepSpeed with a collective gloo lacks). Under
DeepSpeed accelerate's state is set up over gloo first, so that rank 0 alone saves, as on GPUs
(``one_process_zero``).
MODE is one of
  first   train; every update is checked against an EMA of the weights gathered by the engine's
          own API; the final average and the export are written for the second launch
  second  resume from checkpoint-6 in a new launch: the average ends bitwise where ``first`` ended
  each_node  (KIND deepspeed) accelerate not set up and ``save_on_each_node=True``: both ranks of this
          one machine take themselves for its process zero, and the callback refuses the run on
          every rank before the first step
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from accelerate import PartialState
from safetensors.torch import load_file, save_file
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from shardavg import EMA, CheckpointError
from shardavg.integrations.transformers import FOLDER, with_weight_averaging

STEPS, DECAY = 8, 0.9
ZERO3 = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # a resumed run then repeats the same steps
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (count, 12), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class GatheredReference(TrainerCallback):
    """An AveragedModel EMA of the live weights, gathered by the engine's own API after each step."""

    def __init__(self, averaging) -> None:
        self.averaging = averaging
        self.reference = AveragedModel(tiny_gpt2(), multi_avg_fn=get_ema_multi_avg_fn(DECAY))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        import deepspeed

        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(
            list(params.values()), enabled=hasattr(next(iter(params.values())), "ds_id")
        ):
            live = {n: p.detach().clone() for n, p in params.items()}
        plain = tiny_gpt2()
        plain.load_state_dict(live, strict=False)  # tied head: one name
        self.reference.update_parameters(plain)
        got = self.averaging.averager.full_state_dict()
        if dist.get_rank() == 0:
            for name, value in self.reference.module.named_parameters():
                assert torch.equal(got[name], value), f"step {state.global_step}: {name} differs from the reference"


def one_process_zero() -> None:
    """Set accelerate's state up for DeepSpeed over gloo, so that only rank 0 is the Trainer's process zero.

    Without GPUs accelerate finds no backend for DeepSpeed and takes every rank for process 0 of 1:
    each then saves and rotates ``output_dir`` at once, and under load one rank's ``rmtree`` of
    checkpoint-3 made it the newest by mtime to the other, which deleted checkpoint-6 (the run kept
    only checkpoint-8). The callback refuses that set-up under ``save_total_limit``; on GPUs (NCCL)
    accelerate counts the ranks itself, as it does here once told the backend.
    """
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # (how TrainingArguments itself tells accelerate)
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def build(kind: str, root: Path, check: bool):
    if kind == "deepspeed":
        one_process_zero()
    args = TrainingArguments(
        output_dir=str(root / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=3,
        save_total_limit=2,
        # (accelerate gathers eval losses with all_gather_into_tensor under DeepSpeed, which gloo lacks:
        # evaluation runs on GPUs, here only under DDP)
        eval_strategy="steps" if kind == "ddp" else "no",
        eval_steps=4,
        logging_steps=4,
        report_to=[],
        seed=0,
        use_cpu=kind == "ddp",
        deepspeed=ZERO3 if kind == "deepspeed" else None,
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True} if kind == "deepspeed" else None,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(256, 1), eval_dataset=Tokens(16, 2))
    averaging = with_weight_averaging(trainer, EMA(decay=DECAY), export_dir=root / "export")
    if check:
        trainer.add_callback(GatheredReference(averaging))
    return trainer, averaging


def gathered(value: bool) -> list:
    """Every rank's ``value``, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def refused_on_each_node(root: Path) -> None:
    """ZeRO-3 with accelerate not set up and ``save_on_each_node=True``: accelerate takes each rank for
    process 0 of 1, so for local process 0 of its node too, and both ranks of this machine would save
    and rotate ``output_dir`` (before: trained without a word). Refused on every rank before the
    first step, naming the ranks, the host and the fix."""
    args = TrainingArguments(
        output_dir=str(root / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=STEPS, save_strategy="steps", save_steps=3, save_total_limit=2, save_on_each_node=True,
        report_to=[], seed=0, deepspeed=ZERO3, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(256, 1))
    with_weight_averaging(trainer, EMA(decay=DECAY))
    savers = [r for r, saves in enumerate(gathered(args.should_save)) if saves]
    assert savers == [0, 1], f"ranks {savers} save: the set-up this checks is every rank saving"
    with harness.expect_raises(
        CheckpointError,
        f"ranks [0, 1] on host {socket.gethostname()} (of 2) each take themselves for the Trainer's process zero "
        "of their node (save_on_each_node=True expects one per node",
        "save_total_limit=2 keeps",
        '"use_configured_state": True',
    ):
        trainer.train()
    assert not list((root / "out").glob("checkpoint-*")), "a checkpoint was written before the refusal"
    harness.report("REFUSED", {"savers": savers})


@record
def main() -> None:
    mode, kind, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode == "each_node":
        refused_on_each_node(root)
        harness.finish()  # (leaves the process)
    trainer, averaging = build(kind, root, check=mode == "first")
    if mode == "first":
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=str(root / "out" / "checkpoint-6"))
    averager = averaging.averager
    savers = [r for r, saves in enumerate(gathered(trainer.args.should_save)) if saves]
    assert savers == [0], f"ranks {savers} save checkpoints (one process zero expected)"
    assert averager.strategy.name == {"ddp": "replicated", "deepspeed": "zero3"}[kind], averager.strategy.name
    assert (averager.step, averager.num_updates) == (STEPS, STEPS), (averager.step, averager.num_updates)
    final = averager.full_state_dict()
    if dist.get_rank() == 0:
        out = root / "out"
        kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
        assert kept == ["checkpoint-6", "checkpoint-8"], kept  # checkpoint-3 rotated away, its average with it
        assert all((out / name / FOLDER / "shardavg.json").is_file() for name in kept)
        history = [entry for entry in trainer.state.log_history if "eval_avg_loss" in entry]
        expected = [4, 8] if kind == "ddp" else []  # (a resumed run's history holds step 4's from the checkpoint)
        assert [entry["step"] for entry in history] == expected, history
        for entry in history:
            assert entry["eval_avg_loss"] != entry.get("eval_loss"), entry
        exported = load_file(str(root / "export" / "model.safetensors"))
        plain = tiny_gpt2()
        plain.load_state_dict(exported, strict=True)
        assert all(torch.equal(exported[k], v) for k, v in final.items() if k in exported)
        raw = {n: p.detach().clone() for n, p in trainer.model.named_parameters()} if kind == "ddp" else {}
        if mode == "first":
            save_file({k: v.clone() for k, v in final.items()}, str(root / "final.safetensors"))
            save_file(raw, str(root / "raw.safetensors"))
        else:
            raw_want = load_file(str(root / "raw.safetensors"))
            assert all(torch.equal(raw[k], raw_want[k]) for k in raw_want), "the raw weights differ after the resume"
            want = load_file(str(root / "final.safetensors"))
            assert set(want) == set(final) and all(torch.equal(final[k], want[k]) for k in want), "resume differs"
        harness.report("TRAINER", {"mode": mode, "kind": kind, "eval": json.dumps(history[-1:])})
    harness.finish()


if __name__ == "__main__":
    main()
