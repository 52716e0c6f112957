"""torchrun scenario: tensor parallel, FSDP2 + TP, HSDP + TP, expert parallel and pipeline stages.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_layouts.py

For every layout this world size holds (``layouts.py``), the model trains for real while several
averagers follow it (an EMA, a power EMA, a custom ``multi_avg_fn``, three named averages in
one averager, offloaded shadows, averaged buffers); after the run each is compared with a
reference computed in the same run from ``full_tensor()`` of the live weights: bitwise for
fp32, within rounding for bf16. The launch also checks that ``update()`` communicates nothing,
that local shards and fused groups stay the same objects, that every rank's shadow is exactly
its part of the reference (uneven and empty parts included), the shadow bytes against the
local shards, the forward inside ``swapped()`` against the reference model, the placements the
strategy refuses, and for pipeline stages the export against an unpipelined run.
"""

from __future__ import annotations

import sys

import harness
import layouts
import torch
import torch.distributed as dist
from harness import CollectiveCount, Engine, expect_raises
from scenario_averager import StableViews, load_live
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardavg import EMA, PowerEMA, StrategyError, WeightAverager

STEPS, SWAP_AT = 20, 10


def variants() -> dict[str, tuple[dict, object]]:
    """name -> (WeightAverager kwargs, the AveragedModel multi_avg_fn of its reference)."""
    gamma = harness.edm2_gamma(0.1)
    power = lambda avg, live, n: [a.lerp_(b, 1 - (1 - 1 / (int(n) + 1)) ** (gamma + 1)) for a, b in zip(avg, live)]  # noqa: E731
    return {
        "ema": ({"rule": EMA(decay=0.9)}, get_ema_multi_avg_fn(0.9)),
        "power": ({"rule": PowerEMA(sigma_rel=0.1)}, power),
        "fn": ({"rule": get_ema_multi_avg_fn(0.8)}, get_ema_multi_avg_fn(0.8)),
        "offloaded": ({"rule": EMA(decay=0.9), "device": "cpu"}, get_ema_multi_avg_fn(0.9)),
        "buffers": ({"rule": EMA(decay=0.9), "buffers": "average"}, get_ema_multi_avg_fn(0.9)),
    }


def averaged_names(module: nn.Module, name: str) -> set[str]:
    params = {n for n, p in module.named_parameters() if p.requires_grad}
    if name == "buffers":
        params |= {n for n, b in module.named_buffers() if b.is_floating_point()}
    return params


class Reference:
    """AveragedModel of a plain model loaded with the gathered live weights each step; buffers
    averaged or copied as the variant says."""

    def __init__(self, name: str, fn, moe: bool) -> None:
        self.plain = layouts.plain(moe)
        self.model = AveragedModel(self.plain, multi_avg_fn=fn, use_buffers=name == "buffers")
        self.name = name

    def update(self, live: dict[str, torch.Tensor]) -> None:
        load_live(self.plain, live)
        self.model.update_parameters(self.plain)

    def state(self) -> dict[str, torch.Tensor]:
        state = {k: v.clone() for k, v in self.model.module.state_dict().items()}
        if self.name != "buffers":  # buffers copied: the live value (AveragedModel keeps its own)
            state |= {n: b.clone() for n, b in self.plain.named_buffers()}
        return state


def check(label: str, got: dict, want: dict, averaged: set[str], exact: bool) -> None:
    assert set(got) == set(want), f"{label}: names differ from the plain model: {set(got) ^ set(want)}"
    for name, value in want.items():
        value, expected = got[name], value.to(got[name].dtype)
        if exact or name not in averaged:
            assert torch.equal(value, expected), f"{label}: {name} differs by {(value - expected).abs().max()}"
        else:
            where = f"{label}: {name}"
            torch.testing.assert_close(
                value, expected, rtol=1e-5, atol=1e-6, msg=lambda m, where=where: f"{where}: {m}"
            )


def check_parts(label: str, averager: WeightAverager, want: dict[str, torch.Tensor]) -> None:
    """Every rank's shadow is exactly its part of the reference, whatever the part's shape."""
    for info, shadow in zip(averager.tensors, averager.shadows()):
        if shadow is None or averager.options.role(info) != "average":
            continue
        expected = info.part.take(want[info.name].to(shadow.dtype))
        assert torch.equal(shadow.reshape(-1), expected), f"{label}: rank {dist.get_rank()}'s part of {info.name}"


def run(engine: Engine, moe: bool = False, pipeline=None, reference_forward=None) -> dict[str, dict]:
    """Train ``engine`` while every variant averages it; check everything; the EMA's full average."""
    rank = dist.get_rank()
    extra = {} if pipeline is None else {"pipeline": pipeline}
    averagers = {name: WeightAverager(engine.model, **kwargs, **extra) for name, (kwargs, _) in variants().items()}
    several = WeightAverager(engine.model, {"ema": EMA(decay=0.9), "power": PowerEMA(sigma_rel=0.1)}, **extra)
    harness.check_derived_layout(several)
    references = {name: Reference(name, fn, moe) for name, (_, fn) in variants().items()}
    stable, collectives = StableViews(), []
    for step in range(1, STEPS + 1):
        engine.step(step)
        with CollectiveCount() as count:
            for averager in averagers.values():
                averager.update()
            several.update()
        collectives += count.names
        if step > 1:
            for name, averager in averagers.items():
                stable.check(f"{engine.name}/{name}", averager)
        live = {n: t.float() if t.is_floating_point() else t for n, t in engine.gather_live().items()}
        for reference in references.values():
            reference.update(live)
        if step == SWAP_AT and reference_forward is not None:
            reference_forward(averagers["ema"], references["ema"].state())
    assert not collectives, f"{engine.name}: update() issued collectives: {collectives}"
    exact = engine.dtype == torch.float32
    results = {}
    for name, averager in averagers.items():
        want = references[name].state()
        got = averager.full_state_dict()
        assert (got == {}) == (rank != 0), f"{engine.name}/{name}: full_state_dict() on rank {rank}"
        if rank == 0:
            check(f"{engine.name}/{name}", got, want, averaged_names(layouts.plain(moe), name), exact or name == "fn")
        if exact:
            check_parts(f"{engine.name}/{name}", averager, want)
        results[name] = got
    for name in ("ema", "power"):  # each named average is bitwise its single-average twin
        got, want = several.full_state_dict(name), results[name]
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), f"several/{name}"
    harness.check_writers(averagers["ema"], engine.name)
    ema = averagers["ema"]
    local_bytes = sum(engine.local_param_numels().values()) * 4
    local_bytes += sum(v.numel() * v.element_size() for v, info in zip(ema.strategy.local_shards(), ema.tensors)
                       if info.kind == "buffer")  # fmt: skip
    assert ema.shadow_bytes() == local_bytes, f"{engine.name}: shadow bytes {ema.shadow_bytes()} != {local_bytes}"
    shadows = [None] * dist.get_world_size()
    dist.all_gather_object(shadows, ema.shadow_bytes())
    harness.report("LAYOUT", {"config": engine.name, "shadow_bytes_per_rank": shadows, "steps": STEPS})
    return results


def swapped_forward(engine: Engine) -> callable:
    """The forward inside ``swapped()`` is the reference average's; the live weights come back."""

    def check_it(averager: WeightAverager, averaged: dict[str, torch.Tensor]) -> None:
        tokens = harness.probe_tokens().clamp_max(layouts.VOCAB - 1)
        before = engine.gather_live()
        with torch.no_grad(), averager.swapped():
            out = engine.forward(tokens)
        reference = layouts.plain(moe=engine.name.startswith("ep"))
        reference.load_state_dict({k: v for k, v in averaged.items()})
        want = reference.to(engine.dtype)(tokens)
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if engine.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out, want, **tolerance, msg=lambda m: f"{engine.name}: swapped forward: {m}")
        after = engine.gather_live()
        assert all(torch.equal(before[n], after[n]) for n in before), f"{engine.name}: live weights not restored"

    return check_it


def check_refused_placements() -> None:
    """A Partial parameter, and a placement class shardavg does not know, are refused by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, [Partial()], run_check=False))
    with expect_raises(StrategyError, "param 'weight' is Partial", "reduce it"):
        WeightAverager(model)

    class Unknown(Shard):  # a placement of another library, say
        pass

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(DTensor.from_local(torch.zeros(1, 4), mesh, [Unknown(0)], run_check=False))
    if type(model.weight.placements[0]) is Unknown:  # torch 2.13 keeps the class as given
        with expect_raises(StrategyError, "param 'weight' has the placement", "which shardavg does not know"):
            WeightAverager(model)
    else:  # torch 2.14 makes any Shard subclass a Shard (a plain Placement subclass crashes it): none is unknown
        assert model.weight.placements == (Shard(0),), model.weight.placements
        WeightAverager(model)
    model = nn.Linear(4, 4)
    model.register_buffer("stat", DTensor.from_local(torch.zeros(4), mesh, [Partial()], run_check=False))
    with expect_raises(StrategyError, "buffer 'stat' is Partial"):
        WeightAverager(model)


def check_pipeline(dtype: torch.dtype) -> None:
    """Two stages (and FSDP2 within each at 4 ranks): the averages cover the whole model; the
    export loads into the plain model and is, to fp32 rounding, the average of an unpipelined run."""
    pipelined = layouts.Pipelined(dtype)
    engine = pipelined.engine()
    results = run(engine, pipeline=pipelined.group)
    average = WeightAverager(engine.model, EMA(decay=0.9), pipeline=pipelined.group)
    with expect_raises(Exception, "a list of modules is a pipeline's stages"):
        WeightAverager([engine.model], EMA(decay=0.9))
    for step in range(STEPS + 1, STEPS + 3):
        engine.step(step)
        average.update()
    with CollectiveCount() as count, average.swapped():  # per stage, no gather
        pass
    assert not count.names, f"swapped() under a pipeline communicated: {count.names}"
    out = harness_path()
    average.export(out / "pp-export")
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        exported = load_file(str(out / "pp-export" / "model.safetensors"))
        layouts.plain().load_state_dict(exported, strict=True)
        unpipelined = unpipelined_ema(dist.get_world_size() // 2)
        worst = max(float((results["ema"][n] - unpipelined[n]).abs().max()) for n in unpipelined)
        for name, value in unpipelined.items():
            torch.testing.assert_close(
                results["ema"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"pp vs plain {name}: {m}"
            )
        harness.report("PIPELINE", {"world_size": dist.get_world_size(), "max_difference_to_unpipelined": worst})


def unpipelined_ema(data_ranks: int) -> dict[str, torch.Tensor]:
    """The same training in one process without a pipeline: the global batch (every data rank's)
    at once, the EMA kept by AveragedModel."""
    model = layouts.plain()
    optimizer = layouts.optimizer_for(model.parameters())
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for step in range(1, STEPS + 1):
        batches = [layouts.batch(step, r) for r in range(data_ranks)]
        tokens, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = nn.functional.cross_entropy(model(tokens), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reference.update_parameters(model)
    return dict(reference.module.state_dict())


def harness_path():
    from pathlib import Path

    return Path(sys.argv[1])


@record
def main() -> None:
    harness.init_distributed()
    world = dist.get_world_size()
    check_refused_placements()
    for name, build in layouts.layouts(world).items():
        for dtype in (torch.float32, torch.bfloat16) if name in ("fsdp2_tp", "tp") else (torch.float32,):
            engine = build(dtype)
            run(engine, moe=name == "ep", reference_forward=swapped_forward(engine))
            dist.barrier()
    if world in (2, 4):
        check_pipeline(torch.float32)
    harness.report("DONE", {"world_size": world})
    harness.finish()


if __name__ == "__main__":
    main()
