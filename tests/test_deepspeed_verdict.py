"""``integrations.deepspeed.verdict(engine)`` in a real DeepSpeed engine, in one process on the CPU
(``DS_ACCELERATOR=cpu``, gloo): a step whose gradients are NaN is skipped by the engine
(``was_step_applied()`` False, ``skipped_steps`` counted), so ``avg.update(finite=verdict(engine))``
neither averages it nor counts it as applied, and the average equals, bitwise, an EMA built here
independently (``torch.optim.swa_utils.get_ema_multi_avg_fn``) of the gathered weights after the
applied steps only. Between accumulation boundaries no step is applied (``verdict`` raises there): the
loop updates at the boundaries only, as docs/integrations/deepspeed.md says.

Every dtype is explicit in the config (bf16 under ZeRO-3, fp32 under ZeRO-2), and no ``zero.Init``
runs without one: DeepSpeed's dtype then does not depend on the CPU's oneDNN fp16 support
(DESIGN.md). One engine per test; DeepSpeed's first import takes a few seconds, and its first engine
in an environment compiles DeepSpeed's CPU shm op (two C++ files, about a minute of a core each): so
these tests run with the torchrun tier (``slow``), whose ZeRO launches need that build anyway."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (before DeepSpeed is imported: its CPU accelerator)
deepspeed = pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow  # (DeepSpeed's op build, above: python -m pytest -m "not slow" leaves it out)

from shardavg import EMA, WeightAverager  # noqa: E402
from shardavg.integrations.deepspeed import verdict  # noqa: E402

DECAY = 0.75
POISONED = 3  # the optimizer step whose loss (so every gradient) is NaN


@pytest.fixture
def world() -> Iterator[None]:
    """A world of one process (gloo), torn down after the test, the environment as it was, and
    DeepSpeed's cached groups forgotten (``forget_groups``) before and after: the docstring example
    tests/test_docs.py runs in the same process may have left its own."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    names = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    saved = {key: os.environ.get(key) for key in names}
    os.environ.update(names)
    forget_groups()
    try:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        forget_groups()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def forget_groups() -> None:
    """Drop the process groups ``deepspeed.utils.groups`` keeps of a world now destroyed (its
    clone of the world group, the data-parallel ones): the next engine in this process would
    otherwise ask the new world about them."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, torch.distributed.ProcessGroup) for v in value.values()):
            value.clear()


def engine_of(stage: int, dtype: torch.dtype, accumulation: int = 1) -> Any:
    """A small MLP under ZeRO ``stage`` in ``dtype`` (the config says which: bf16 enabled, or
    neither bf16 nor fp16 for fp32), every parameter partitioned under ZeRO-3, SGD with momentum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # (or a model this small is never partitioned)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DeepSpeed's own deprecation notices)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def micro_step(engine: Any, step: int, poisoned: bool = False) -> None:
    """One forward and backward on a batch fixed by ``step``; with ``poisoned``, a NaN loss."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(4, 6, generator=generator).to(engine.module[0].weight.dtype)
    loss = engine(inputs).float().pow(2).mean()
    engine.backward(loss * float("nan") if poisoned else loss)


def gathered(engine: Any) -> list[torch.Tensor]:
    """The engine's full live weights, in the module's order (ZeRO-3 gathers them; a world of one)."""
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=engine.zero_optimization_stage() == 3):
        return [parameter.detach().clone() for parameter in parameters]


def reference_ema(snapshots: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """torch's own EMA (``get_ema_multi_avg_fn``, as ``AveragedModel`` runs it) of ``snapshots``
    in fp32: the first copied, as ``AveragedModel`` and the averager's first update do."""
    update = get_ema_multi_avg_fn(DECAY)
    average = [tensor.float().clone() for tensor in snapshots[0]]
    for count, live in enumerate(snapshots[1:], start=1):
        update(average, [tensor.float() for tensor in live], torch.tensor(count))
    return average


def assert_average(avg: WeightAverager, engine: Any, snapshots: list[list[torch.Tensor]]) -> None:
    got = avg.full_state_dict()
    names = [name for name, _ in engine.module.named_parameters()]
    assert list(got) == names
    for name, want in zip(names, reference_ema(snapshots)):
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize(
    ("stage", "dtype"), [(3, torch.bfloat16), (2, torch.float32)], ids=["zero3-bf16", "zero2-fp32"]
)
def test_a_step_the_engine_skipped_is_never_averaged(world, stage: int, dtype: torch.dtype) -> None:
    engine = engine_of(stage, dtype)
    assert engine.module[0].weight.dtype == dtype  # (the config's, whatever this CPU supports)
    if stage == 3:  # (really partitioned: each rank's shard is its ds_tensor)
        assert all(p.ds_tensor.numel() == p.ds_numel for p in engine.module.parameters())
    avg = WeightAverager(engine, EMA(decay=DECAY))
    assert avg.updater.state.strategy.name == ("zero3" if stage == 3 else "replicated")
    snapshots = []
    for step in range(1, 7):
        before = gathered(engine)
        micro_step(engine, step, poisoned=step == POISONED)
        engine.step()
        given = verdict(engine)
        if step == POISONED:
            assert given is False and not engine.was_step_applied() and engine.skipped_steps == 1
            assert all(torch.equal(a, b) for a, b in zip(before, gathered(engine))), "the engine moved the weights"
            with pytest.warns(RuntimeWarning, match=rf"skipping the update at step {POISONED} on rank 0"):
                assert avg.update(finite=given) is False
        else:
            assert engine.was_step_applied() and given is not None and given is not False
            assert bool(torch.isfinite(torch.as_tensor(given)))  # the engine's global norm, finite
            assert avg.update(finite=given) is True
            snapshots.append(gathered(engine))
    assert (avg.num_updates, avg.num_skipped, avg.step) == (5, 1, 6)
    assert_average(avg, engine, snapshots)


def test_between_accumulation_boundaries_no_step_is_applied(world) -> None:
    """With 2 micro-steps per optimizer step, ``engine.step()`` applies a step at every second
    call only, and ``verdict`` refuses to answer after the others: the loop updates the average at the
    boundaries (known before ``engine.step()``), so it counts optimizer steps, and the skip of a
    poisoned optimizer step once."""
    engine = engine_of(3, torch.bfloat16, accumulation=2)
    avg = WeightAverager(engine, EMA(decay=DECAY))
    snapshots = []
    for micro in range(1, 13):
        boundary = engine.is_gradient_accumulation_boundary()  # (asked before step(), which moves past it)
        assert boundary == (micro % 2 == 0)
        micro_step(engine, micro, poisoned=micro == 2 * POISONED - 1)  # (its NaN reaches the boundary's step)
        engine.step()
        if not boundary:
            assert not engine.was_step_applied()
            with pytest.raises(ValueError, match=rf"after micro-step {micro}, between gradient accumulation"):
                verdict(engine)
            continue
        given = verdict(engine)
        if micro == 2 * POISONED:
            assert given is False and engine.skipped_steps == 1
            with pytest.warns(RuntimeWarning, match=rf"skipping the update at step {POISONED} on rank 0"):
                avg.update(finite=given)
        else:
            assert avg.update(finite=given) is True
            snapshots.append(gathered(engine))
    assert (avg.num_updates, avg.num_skipped, avg.step, engine.global_steps) == (5, 1, 6, 6)
    assert_average(avg, engine, snapshots)
