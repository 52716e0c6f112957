"""torchrun scenario: a Hugging Face model keeps its own names under every engine and wrapper order.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_names.py OUT

A tiny ``GPT2LMHeadModel`` (built from a config, nothing downloaded) is wrapped the ways
people wrap it: activation checkpointing before or after the engine, a per-block
``torch.compile``, and the block class as FSDP1's wrap policy (so FSDP units sit inside the
checkpoint and compile wrappers). For each, after a real training step with a zero learning
rate (so the live weights stay the seed's), the averager's ``full_state_dict()``, ``copy_to()``,
checkpoint manifest and export must carry exactly the plain model's names and values, and
``from_pretrained`` must load the export with nothing missing or unexpected.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.elastic.multiprocessing.errors import record
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from shardavg import EMA, WeightAverager
from shardavg.offline.saved_average import SavedAverage

CONFIG = GPT2Config(
    vocab_size=67,  # not divisible by the world size
    n_positions=16,
    n_embd=12,
    n_layer=2,
    n_head=2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def is_block(module: nn.Module) -> bool:
    return isinstance(module, GPT2Block)


def checkpointed(model: nn.Module) -> nn.Module:
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=is_block)
    return model


def compiled_blocks(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    for index, block in enumerate(model.transformer.h):
        model.transformer.h[index] = torch.compile(block, backend="eager")
    return model


def blocks(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if is_block(module)]


# ----------------------------------------------------------------------------- engines


def fsdp1(prepare: Callable, after: Callable = lambda m: m, use_orig_params: bool = True) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapped = FSDP(
        prepare(gpt2()),
        auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    return after(wrapped)


def fsdp2(prepare: Callable, after: Callable = lambda m: m) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = prepare(gpt2())
    for block in blocks(model):
        fully_shard(block)
    fully_shard(model)
    return after(model)


def ddp(prepare: Callable) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(prepare(gpt2()))


def zero3(prepare: Callable, after: Callable = lambda m: m) -> nn.Module:
    import deepspeed

    model = prepare(gpt2())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    after(engine.module)
    return engine


def wrappings() -> dict[str, Callable[[], nn.Module]]:
    same = lambda model: model  # noqa: E731
    return {
        "fsdp1-checkpoint-before": functools.partial(fsdp1, checkpointed),
        "fsdp1-checkpoint-after": functools.partial(fsdp1, same, checkpointed),
        "fsdp1-flat-checkpoint-before": functools.partial(fsdp1, checkpointed, use_orig_params=False),
        "fsdp1-compiled-blocks": functools.partial(fsdp1, compiled_blocks),
        "fsdp1-compiled-units": functools.partial(fsdp1, same, compiled_blocks),  # torch's FSDP1 recipe
        "fsdp2-checkpoint-before": functools.partial(fsdp2, checkpointed),
        "fsdp2-checkpoint-after": functools.partial(fsdp2, same, checkpointed),
        "fsdp2-compiled-blocks": functools.partial(fsdp2, compiled_blocks),
        "ddp-checkpoint-and-compiled-blocks": functools.partial(ddp, lambda m: checkpointed(compiled_blocks(m))),
        "zero3-checkpoint-before": functools.partial(zero3, checkpointed),
        "zero3-checkpoint-after": functools.partial(zero3, same, checkpointed),
        "zero3-compiled-blocks": functools.partial(zero3, compiled_blocks),
    }


# ----------------------------------------------------------------------------- checks


# Built, not run, as neither engine runs them: dynamo cannot trace an FSDP1 unit inside a
# compiled block (it sees the flat shards; compiling the FSDP1 units instead runs), and
# DeepSpeed 0.19's forward hook fails on a compiled submodule (it has its own engine.compile()).
UNTRAINABLE = {"fsdp1-compiled-blocks", "zero3-compiled-blocks"}


def train_one_step(model: nn.Module) -> None:
    """A real forward, backward and optimizer step; the zero learning rate keeps the seed's weights."""
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    if hasattr(model, "backward"):  # a DeepSpeedEngine
        model.backward(model(tokens, labels=tokens).loss)
        model.step()
        return
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def check(label: str, model: nn.Module, out: Path) -> None:
    plain = gpt2().state_dict()
    averager = WeightAverager(model, EMA(decay=0.9))
    if label not in UNTRAINABLE:
        train_one_step(model)
    assert averager.update()

    got = averager.full_state_dict()
    if dist.get_rank() == 0:
        assert set(got) == set(plain), f"{label}: missing {set(plain) - set(got)}, unexpected {set(got) - set(plain)}"
        for name, value in plain.items():
            assert torch.equal(got[name], value), f"{label}: {name} is not the plain model's value"

    target = gpt2()
    with torch.no_grad():
        for tensor in target.state_dict().values():
            tensor.zero_()
    averager.copy_to(target)
    for name, value in target.state_dict().items():
        assert torch.equal(value, plain[name]), f"{label}: copy_to() wrote {name} wrong on rank {dist.get_rank()}"

    saved = averager.save(out / label / "checkpoint")
    export = averager.export(out / label / "export")
    if dist.get_rank() == 0:
        names = {name for entry in SavedAverage(saved).description.tensors for name in entry.names}
        assert names == set(plain), f"{label}: the checkpoint names {sorted(names ^ set(plain))}"
        CONFIG.save_pretrained(export)
        loaded, info = GPT2LMHeadModel.from_pretrained(export, output_loading_info=True)
        problems = {key: value for key, value in info.items() if value}
        assert not problems, f"{label}: from_pretrained reports {problems}"
        tokens = torch.arange(10).view(1, 10)
        reference = gpt2().eval()
        assert torch.equal(loaded.eval()(tokens).logits, reference(tokens).logits), f"{label}: logits differ"
        harness.report("NAMES", {"wrapping": label})
    dist.barrier()


@record
def main() -> None:
    out = Path(sys.argv[1])
    harness.init_distributed(deepspeed=True)
    harness.report("PLANNED", {"wrappings": list(wrappings())})
    for label, build in wrappings().items():
        check(label, build(), out)
    harness.finish()


if __name__ == "__main__":
    main()
