"""torchrun scenarios for ``shardavg.integrations.accelerate`` (accelerate on CPU).

    ACCELERATE_USE_CPU=true [ACCELERATE_USE_DEEPSPEED=true] \\
    torchrun --standalone --nproc_per_node N tests_distributed/scenario_accelerate.py MODE KIND ROOT

KIND is ``ddp`` (accelerate's MULTI_CPU), ``deepspeed`` (its DeepSpeed plugin at ZeRO-3) or
``fsdp2`` (its FSDP plugin, version 2: needs a GPU, on CPU accelerate turns it into DDP).
Training uses gradient accumulation 2; the averager updates when ``sync_gradients``.
MODE is one of
  first   train, checking each update against an EMA of the gathered live weights; save_state
          half-way (the averages then are written as ``at-save``), train on (``at-end``)
  second  a new launch at the same world size: load_state, the averages equal ``at-save``,
          train on: they equal ``at-end``, bit for bit
  other   a new launch at another world size: load_state, the averages equal ``at-save``
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardavg import EMA, SWA, CheckpointError, WeightAverager
from shardavg.integrations.accelerate import attach, load_state

RULES = {"ema": EMA(decay=0.9), "swa": SWA()}
ACCUMULATION = 2
STEPS = 4  # optimizer steps before the save, and again after it


def build(kind: str):
    from accelerate import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    plugins: dict = {}
    if kind == "deepspeed":
        config = {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": ACCUMULATION,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
        }
        plugins["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=config)
    elif kind == "fsdp2":
        plugins["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, **plugins)
    torch.manual_seed(0)
    module = harness.TiedNet()
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
    model, optimizer = accelerator.prepare(module, optimizer)
    avg = WeightAverager(model, RULES)
    attach(accelerator, avg)
    return accelerator, model, optimizer, avg


def gathered_live(accelerator, model) -> dict[str, torch.Tensor]:
    """The full fp32 live parameters and buffers on every rank, through the engine's own gather."""
    plain = accelerator.unwrap_model(model)
    params = dict(plain.named_parameters())
    if getattr(params[next(iter(params))], "ds_id", None) is not None:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            state = {n: p.detach().clone() for n, p in params.items()}
    else:
        state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params.items()}
    return state | {n: b.detach().clone() for n, b in plain.named_buffers()}


def train(accelerator, model, optimizer, avg, steps: range, reference: AveragedModel | None) -> None:
    """``len(steps)`` optimizer steps of ``ACCUMULATION`` micro-batches each."""
    for step in steps:
        for micro in range(ACCUMULATION):
            with accelerator.accumulate(model):
                tokens, targets = (t.to(accelerator.device) for t in harness.batch(ACCUMULATION * step + micro))
                loss = nn.functional.cross_entropy(model(tokens).float(), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                avg.update()
                if reference is not None:
                    live = harness.TiedNet().to(accelerator.device)  # (the reference lerps where ours does)
                    live.load_state_dict(gathered_live(accelerator, model), strict=False)  # tied: one name
                    reference.update_parameters(live)
                    check_against(avg, reference, f"step {step}")


def check_against(avg: WeightAverager, reference: AveragedModel, label: str) -> None:
    got = avg.full_state_dict("ema")
    if dist.get_rank() == 0:
        for name, value in reference.module.named_parameters():
            if value.requires_grad:
                assert torch.equal(got[name], value.cpu()), f"{label}: {name} differs from the gathered reference"


def averages(avg: WeightAverager) -> dict[str, dict[str, torch.Tensor]]:
    return {name: avg.full_state_dict(name) for name in RULES}


def write(root: Path, label: str, state: dict) -> None:
    if dist.get_rank() == 0:
        for name, tensors in state.items():
            save_file({k: v.clone() for k, v in tensors.items()}, str(root / f"{label}-{name}.safetensors"))


def assert_equal(root: Path, label: str, state: dict) -> None:
    if dist.get_rank() != 0:
        return
    for name, tensors in state.items():
        want = load_file(str(root / f"{label}-{name}.safetensors"))
        assert set(tensors) == set(want), f"{label}/{name}: names differ"
        for key, value in want.items():
            assert torch.equal(tensors[key], value), f"{label}/{name}: {key} differs"


def refuse_a_damaged_average(accelerator, model, root: Path) -> None:
    """``load_state`` checks the average before the model moves: here rank 1's file of the average,
    which holds no tensor under DDP (rank 0 owns every one), is gone."""
    import shutil

    damaged = root / "damaged"
    if dist.get_rank() == 0:
        shutil.copytree(root / "checkpoint", damaged)
        (damaged / "shardavg" / "rank-00001-of-00002.safetensors").unlink()
    dist.barrier()
    before = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    with harness.expect_raises(CheckpointError, "missing checkpoint file", "rank-00001-of-00002.safetensors"):
        load_state(accelerator, damaged)
    after = dict(accelerator.unwrap_model(model).named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before), "the model loaded before the average was refused"


@record
def main() -> None:
    mode, kind, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    accelerator, model, optimizer, avg = build(kind)
    assert avg.strategy.name == {"ddp": "replicated", "deepspeed": "zero3", "fsdp2": "fsdp2"}[kind], avg.strategy.name
    if mode == "first":
        torch.manual_seed(0)
        reference = AveragedModel(harness.TiedNet().to(accelerator.device), multi_avg_fn=get_ema_multi_avg_fn(0.9))
        train(accelerator, model, optimizer, avg, range(1, STEPS + 1), reference)
        assert avg.num_updates == STEPS, f"{avg.num_updates} updates for {STEPS} optimizer steps"
        accelerator.save_state(str(root / "checkpoint"))
        write(root, "at-save", averages(avg))
        train(accelerator, model, optimizer, avg, range(STEPS + 1, 2 * STEPS + 1), reference)
        write(root, "at-end", averages(avg))
    else:
        if mode == "other":
            refuse_a_damaged_average(accelerator, model, root)
        accelerator.load_state(str(root / "checkpoint"))
        assert (avg.num_updates, avg.step) == (STEPS, STEPS), (avg.num_updates, avg.step)
        assert_equal(root, "at-save", averages(avg))
        if mode == "second":
            train(accelerator, model, optimizer, avg, range(STEPS + 1, 2 * STEPS + 1), None)
            assert_equal(root, "at-end", averages(avg))
    harness.report("DONE", {"mode": mode, "kind": kind, "world_size": dist.get_world_size()})
    accelerator.wait_for_everyone()
    harness.finish()


if __name__ == "__main__":
    main()
