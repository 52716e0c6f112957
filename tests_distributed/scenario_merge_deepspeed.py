"""torchrun scenario: ``shardavg merge`` reads real DeepSpeed ZeRO-1/2/3 saves as DeepSpeed's own reader does.

    torchrun --standalone --nproc_per_node 2 tests_distributed/scenario_merge_deepspeed.py ROOT

For each ZeRO stage (3 with every parameter partitioned, and with DeepSpeed's default persistence
threshold; 2 also in bf16) a TiedNet (tied embeddings, a frozen submodule, BatchNorm buffers) trains
3 steps, saving a tag each step. Rank 0 then reads every tag with ``open_source`` and compares each
tensor, bit for bit, with DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, and merges the
newest two tags (``--last 2``) against numpy's average of DeepSpeed's own reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import shardavg
from shardavg.offline.sources import open_source

CASES = [(1, False, None), (2, False, None), (2, True, None), (3, False, 0), (3, False, None)]


def train(run: Path, stage: int, bf16: bool, threshold: int | None) -> None:
    import deepspeed

    zero: dict = {"stage": stage}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }
    torch.manual_seed(0)
    module = harness.TiedNet().to(torch.bfloat16 if bf16 else torch.float32)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    for step in range(3):
        tokens, targets = harness.batch(step)
        engine.backward(nn.functional.cross_entropy(engine(tokens).float(), targets))
        engine.step()
        engine.save_checkpoint(str(run), tag=f"global_step{step + 1}")


def check(run: Path, label: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    wants = {}
    for step in (1, 2, 3):
        tag = f"global_step{step}"
        want = get_fp32_state_dict_from_zero_checkpoint(str(run), tag=tag)
        source = open_source(run / tag)
        names = dict(source.specs) | {alias: None for _, alias in source.ties}
        assert sorted(names) == sorted(want), (label, sorted(set(names) ^ set(want)))
        owner = {alias: first for first, alias in source.ties}
        for name, value in want.items():
            got = source.read(owner.get(name, name))
            assert got.dtype == value.dtype and torch.equal(got, value), (label, tag, name)
        wants[step] = want
    out = shardavg.merge(run, run.parent / f"{label}-merged", last=2)
    merged = load_file(str(out / "model.safetensors"))
    for name, value in wants[3].items():
        if not value.is_floating_point():
            continue
        expected = wants[2][name].detach().float().numpy().astype(np.float32) * np.float32(0.5)
        expected = expected + value.detach().float().numpy().astype(np.float32) * np.float32(0.5)
        assert torch.equal(merged[name], torch.from_numpy(expected).to(value.dtype)), (label, name)
    harness.report("MERGED_ZERO", {"label": label, "tensors": len(wants[3])})


@record
def main() -> None:
    root = Path(sys.argv[1])
    harness.init_distributed(deepspeed=True)
    for stage, bf16, threshold in CASES:
        label = f"zero{stage}" + ("-bf16" if bf16 else "") + (f"-persist{threshold}" if threshold is not None else "")
        train(root / label, stage, bf16, threshold)
        dist.barrier()
        if dist.get_rank() == 0:
            check(root / label, label)
        dist.barrier()
    harness.finish()


if __name__ == "__main__":
    main()
