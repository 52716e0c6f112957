"""torchrun scenario: every rule and policy of WeightAverager on each engine, against references.

    torchrun --standalone --nproc_per_node N tests_distributed/scenario_averager.py ENGINE[,ENGINE...]

ENGINE is replicated (DDP), fsdp2, fsdp1 or zero3; several run one after the other in one launch
(the launch costs more than an engine's checks). For each configuration of an engine
(dtypes, FSDP1's use_orig_params, ZeRO-3's persistence threshold and zero.Init) it trains
the model for real, keeps several averagers at once and, after the run, checks each against
a reference average computed in the same run from the live weights gathered by the engine's
own API: bitwise for fp32, within fp32 rounding for bf16 live weights.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import harness
import torch
import torch.distributed as dist
from harness import Engine, PlainAverage, TiedNet, expect_raises
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_avg_fn

import shardavg
from shardavg import EMA, SWA, InverseGammaWarmup, PowerEMA, RatioWarmup, StrategyError, WeightAverager

STEPS, SWAP_AT = 24, 12


def configurations(engine: str, world: int) -> list:
    bf16, fp32 = torch.bfloat16, torch.float32
    if engine == "replicated":
        return [lambda: harness.build_ddp(fp32), lambda: harness.build_ddp(bf16)]
    if engine == "fsdp2":
        hsdp = [lambda: harness.build_hsdp(fp32)] if world == 4 else []  # 2 replicas x 2 shards
        return [lambda: harness.build_fsdp2(fp32), lambda: harness.build_fsdp2(bf16), *hsdp]
    if engine == "fsdp1":
        hybrid = [lambda: harness.build_fsdp1(fp32, True, hybrid=True)] if world == 4 else []  # 2 x 2
        return [lambda d=d, o=o: harness.build_fsdp1(d, o) for d in (fp32, bf16) for o in (True, False)] + hybrid
    if engine == "zero3":

        def without_fp16(build):  # as on a CPU without oneDNN fp16, whatever this one has
            def built() -> Engine:
                with harness.fp16_support(False):
                    return build()

            return built

        return [
            lambda: harness.build_zero3(fp32, None, via_zero_init=False),  # small params persist whole
            lambda: harness.build_zero3(fp32, 0, via_zero_init=False),  # everything partitioned
            lambda: harness.build_zero3(bf16, 0, via_zero_init=False),
            without_fp16(lambda: harness.build_zero3(fp32, 0, via_zero_init=True, average_before_initialize=True)),
            # A user's zero.Init(dtype=torch.float32) there: the engine holds bf16, the averager averages that.
            without_fp16(lambda: harness.build_zero3(fp32, 0, via_zero_init=True, init_dtype=fp32)),
        ]
    raise SystemExit(f"unknown engine {engine!r}")


def check_zero_init_dtype_does_not_depend_on_the_cpu() -> None:
    """zero.Init as the scenarios build it holds the config's dtype whatever the CPU says of fp16;
    asked for a dtype explicitly, DeepSpeed 0.19 holds bf16 on CPUs without oneDNN fp16."""
    import deepspeed

    for supported in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": dtype == torch.bfloat16}}
            with harness.fp16_support(supported), deepspeed.zero.Init(config_dict_or_path=config):
                module = TiedNet()
            held = harness.partition_dtypes(module)
            assert held == {dtype}, f"zero.Init from a config ({dtype}, fp16 support {supported}) holds {held}"
    with harness.fp16_support(False), deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):
        module = TiedNet()
    held = harness.partition_dtypes(module)
    harness.report("ZERO_INIT_ASKED_FLOAT32_WITHOUT_FP16", {"held": sorted(str(d) for d in held)})


def variants() -> dict[str, tuple[dict, object]]:
    """name -> (WeightAverager kwargs, reference): AveragedModel multi_avg_fn, an AveragedModel or a PlainAverage."""
    gamma = harness.edm2_gamma(0.1)
    half_life_decay = 0.5 ** (1 / 4)
    return {
        "ema": ({"rule": EMA(decay=0.9)}, get_ema_multi_avg_fn(0.9)),
        "ema_inverse_gamma": (
            {"rule": EMA(decay=0.95, warmup=InverseGammaWarmup(inv_gamma=1.0, power=0.75))},
            PlainAverage(lambda n: 1 - min(0.95, 1 - (1 + n / 1.0) ** -0.75)),
        ),
        "ema_half_life_ratio": (
            {"rule": EMA(half_life=4, warmup=RatioWarmup())},
            PlainAverage(lambda n: 1 - min(half_life_decay, (1 + n) / (10 + n))),
        ),
        "swa_every3_from5": (
            {"rule": SWA(), "every_n_steps": 3, "start_step": 5},
            PlainAverage(lambda n: 1 / (n + 1), every_n_steps=3, start_step=5),
        ),
        "power_ema": ({"rule": PowerEMA(sigma_rel=0.1)}, PlainAverage(lambda n: 1 - (1 - 1 / (n + 1)) ** (gamma + 1))),
        "custom_multi_avg_fn": ({"rule": get_ema_multi_avg_fn(0.8)}, get_ema_multi_avg_fn(0.8)),
        # a per-tensor avg_fn applied to shards: bitwise torch's on the full tensors (SWA's keeps a frozen value exact)
        "avg_fn": ({"avg_fn": get_swa_avg_fn()}, AveragedModel(TiedNet(), avg_fn=get_swa_avg_fn())),
        "average_buffers_and_frozen": (
            {"rule": EMA(decay=0.9), "buffers": "average", "include_frozen": True},
            PlainAverage(lambda n: 1 - 0.9, average_buffers=True, include_frozen=True),
        ),
        "ema_include_exclude": (  # the blocks and the embedding, but block.up; gain and block.up copied
            {"rule": EMA(decay=0.9), "include": ["block.*", "embed.weight"], "exclude": ["block.up.*"]},
            PlainAverage(lambda n: 1 - 0.9, copied=frozenset({"block.up.weight", "block.up.bias", "gain"})),
        ),
        "ema_offloaded": ({"rule": EMA(decay=0.9), "device": "cpu"}, get_ema_multi_avg_fn(0.9)),
        "ema_background": ({"rule": EMA(decay=0.9), "background": True}, get_ema_multi_avg_fn(0.9)),
        "average_buffers_offloaded_in_background": (  # (the buffers a forward writes: copied by update())
            {"rule": EMA(decay=0.9), "buffers": "average", "include_frozen": True, "device": "cpu", "background": True},
            PlainAverage(lambda n: 1 - 0.9, average_buffers=True, include_frozen=True),
        ),
    }


# the named averages of one averager, each checked against the variant averaged alone
SEVERAL = {"ema": "ema", "power": "power_ema", "fn": "custom_multi_avg_fn"}


def load_live(module: torch.nn.Module, live: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            tensor.copy_(live[name])


def reference_state(reference: object) -> dict[str, torch.Tensor]:
    if isinstance(reference, AveragedModel):
        return {k: v.clone() for k, v in reference.module.state_dict().items()}
    state = dict(reference.state)
    state["head.weight"] = state["embed.weight"]  # tied: the plain state_dict has both names
    return state


def check_average(label: str, got: dict, want: dict, averaged: set[str], live_dtype: torch.dtype, exact: bool) -> None:
    plain_names = set(TiedNet().state_dict())
    assert set(got) == plain_names, f"{label}: names differ from the plain model: {set(got) ^ plain_names}"
    for name, expected in want.items():
        value = got[name]
        if name in averaged:
            assert value.dtype == torch.float32, f"{label}: {name} is {value.dtype}, expected an fp32 average"
            if exact:
                assert torch.equal(value, expected), f"{label}: {name} differs: max {(value - expected).abs().max()}"
            else:
                torch.testing.assert_close(
                    value, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{label}: {name}: {m}"
                )
        else:  # live values (frozen parameters, copied buffers) keep the live dtype and are exact
            if value.is_floating_point():
                assert value.dtype == live_dtype, f"{label}: {name} is {value.dtype}, expected live {live_dtype}"
            assert torch.equal(value.float(), expected.float()), f"{label}: {name} is not the live value"
    TiedNet().load_state_dict(got, strict=True)


class _Boom(Exception):
    pass


def check_swapped(engine: Engine, averager: WeightAverager, averaged: dict[str, torch.Tensor]) -> None:
    """The forward inside swapped() is the reference average's; the live weights come back bit for bit."""
    tokens = harness.probe_tokens()
    engine.model.eval()
    before = engine.gather_live()
    with torch.no_grad(), averager.swapped():
        out = engine.forward(tokens)
    reference = TiedNet()
    reference.load_state_dict(averaged)
    want = reference.to(engine.dtype).eval()(tokens)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if engine.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, want, **tolerance, msg=lambda m: f"{engine.name}: swapped forward: {m}")
    with torch.no_grad():
        assert not torch.equal(out, engine.forward(tokens)), "the swapped forward used the live weights"
    after = engine.gather_live()
    for name in before:
        assert torch.equal(before[name], after[name]), f"{engine.name}: {name} not restored after swapped()"
    try:
        with torch.no_grad(), averager.swapped():
            engine.forward(tokens)
            raise _Boom
    except _Boom:
        pass
    after_error = engine.gather_live()
    for name in before:
        assert torch.equal(before[name], after_error[name]), f"{engine.name}: {name} not restored after an error"
    engine.model.train()


def check_bad_strategies(engine: Engine, expected: str) -> None:
    for other in shardavg.strategies.STRATEGIES:
        if other != expected:
            with expect_raises(StrategyError, f"strategy {other!r} does not fit", repr(expected)):
                WeightAverager(engine.model, strategy=other)
    with expect_raises(StrategyError, "unknown strategy 'fsdp3'"):
        WeightAverager(engine.model, strategy="fsdp3")


def check_update_bn(averager: WeightAverager, reference: AveragedModel) -> None:
    """BatchNorm statistics recomputed under the average (SWA's last step): every rank runs torch's
    update_bn over the same batches inside swapped(), and the average keeps them; they equal, bit
    for bit, torch's update_bn on the single-process reference, and the live buffers come back."""
    generator = torch.Generator().manual_seed(11)
    loader = [torch.randint(0, harness.VOCAB, (8, 5), generator=generator) for _ in range(4)]
    live = {name: buffer.clone() for name, buffer in averager.strategy.module.named_buffers()}
    kept = averager.update_bn(loader)
    statistics = ["block.norm.num_batches_tracked", "block.norm.running_mean", "block.norm.running_var"]
    assert sorted(kept) == statistics, kept
    for name, buffer in averager.strategy.module.named_buffers():
        assert torch.equal(buffer, live[name]), f"update_bn: the live {name} did not come back"
    got = averager.full_state_dict()
    torch.optim.swa_utils.update_bn(loader, reference)
    if dist.get_rank() == 0:
        want = reference.module.state_dict()
        for name in statistics:
            assert torch.equal(got[name].to(want[name].dtype), want[name]), f"update_bn: {name}"
            assert got[name].dtype == want[name].dtype or want[name].is_floating_point(), name


def check_nonfinite_on_one_rank(engine: Engine) -> None:
    """A NaN in rank 1's shard: 'raise' names it there, 'skip' skips there, and the export refuses to mix."""
    averagers = {
        policy: WeightAverager(engine.model, EMA(decay=0.9), on_nonfinite=policy) for policy in ("raise", "skip")
    }
    for averager in averagers.values():
        averager.update()
    with torch.no_grad():
        local = engine.model.block.up.weight.to_local()
    saved = local.clone()
    if dist.get_rank() == 1:
        local.view(-1)[0] = float("nan")
        with expect_raises(shardavg.NonFiniteError, "block.up.weight", "rank 1"):
            averagers["raise"].update()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert averagers["skip"].update() is False
        assert any("block.up.weight" in str(w.message) for w in caught), [str(w.message) for w in caught]
        local.copy_(saved)
    else:
        assert averagers["skip"].update() is True
    with expect_raises(RuntimeError, "ranks disagree on the number of updates"):
        averagers["skip"].full_state_dict()
    check_nonfinite_in_the_background(engine, rank=1)
    check_a_false_verdict_screens_every_rank(engine)


def check_a_false_verdict_screens_every_rank(engine: Engine) -> None:
    """The loop's norm is inf on every rank (clip_grad_norm_'s total); the NaN it had the optimizer
    write lies in rank 1's shard. The update is skipped everywhere and each rank screens its own
    shards at that step: rank 1 raises under 'raise' (rank 0, finite, skips with the verdict's
    warning); under 'skip' rank 1 keeps skipping while the NaN stays, though the next verdict is
    true, and its average never holds it. Trusted before (a clean screen, screen_every=100)."""
    averagers = {
        policy: WeightAverager(engine.model, EMA(decay=0.9), on_nonfinite=policy) for policy in ("raise", "skip")
    }
    for averager in averagers.values():
        averager.update(1, finite=True)  # the first update screens: trusted from here
        averager.update(2, finite=True)
    local = engine.model.block.up.weight.to_local()
    saved = local.detach().clone()
    if dist.get_rank() == 1:
        with torch.no_grad():
            local.view(-1)[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dist.get_rank() == 1:
            with expect_raises(shardavg.NonFiniteError, "block.up.weight", "rank 1", "step 3", "verdict"):
                averagers["raise"].update(3, finite=False)
        else:
            assert averagers["raise"].update(3, finite=False) is False
        assert averagers["skip"].update(3, finite=False) is False
        assert averagers["skip"].update(4, finite=True) is (dist.get_rank() != 1)
    said = [str(w.message) for w in caught]
    if dist.get_rank() == 1:
        assert sum("block.up.weight" in text for text in said) == 2, said  # steps 3 and 4
        assert averagers["skip"].num_skipped == 2
    else:
        assert all("loop's verdict was false" in text for text in said) and len(said) == 2, said
    for averager in averagers.values():
        stored = [shadow for shadow in averager.shadows() if shadow is not None and shadow.is_floating_point()]
        assert all(shadow.isfinite().all() for shadow in stored), "NaN entered the average"
    with torch.no_grad():
        local.copy_(saved)


def check_nonfinite_in_the_background(engine: Engine, rank: int) -> None:
    """In the background a NaN in rank ``rank``'s shard surfaces at the next call there, naming
    the tensor and the step: raised once under 'raise' (the average untouched), warned and
    counted under 'skip'."""
    averagers = {
        policy: WeightAverager(engine.model, EMA(decay=0.9), on_nonfinite=policy, background=True)
        for policy in ("raise", "skip")
    }
    for averager in averagers.values():
        averager.update(1)
        averager.wait()  # (a write to the weights other than an optimizer step's waits by hand)
    local = engine.model.block.up.weight.to_local()
    saved = local.detach().clone()
    if dist.get_rank() == rank:
        with torch.no_grad():
            local.view(-1)[0] = float("nan")
        assert averagers["raise"].update(2) is True  # handed off: the verdict comes later
        with expect_raises(shardavg.NonFiniteError, "block.up.weight", f"rank {rank}", "step 2"):
            averagers["raise"].wait()
        averagers["raise"].wait()  # raised once
        assert averagers["raise"].num_updates == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            averagers["skip"].update(2)
            assert averagers["skip"].num_skipped == 1 and averagers["skip"].num_updates == 1
        assert any("block.up.weight" in str(w.message) and "step 2" in str(w.message) for w in caught), caught
        with torch.no_grad():
            local.copy_(saved)


def check_copy_to_gives_every_rank_the_same_average(averager: WeightAverager, full: dict) -> None:
    """copy_to() writes rank 0's full_state_dict() on every rank, the owners' buffers included,
    although each rank's own BatchNorm statistics differ (checked, so this cannot pass vacuously)."""
    running = [None] * dist.get_world_size()
    dist.all_gather_object(running, averager.strategy.module.block.norm.running_mean.clone())
    assert dist.get_world_size() == 1 or any(not torch.equal(running[0], r) for r in running[1:]), (
        "every rank has the same BatchNorm statistics: copy_to() would pass without the owner's value"
    )
    target = TiedNet()
    averager.copy_to(target)
    want = [full]
    dist.broadcast_object_list(want, src=0)
    got = target.state_dict()
    assert set(got) == set(want[0])
    for name, value in want[0].items():
        assert torch.equal(got[name], value.to(got[name].dtype)), f"rank {dist.get_rank()}: copy_to() {name} differs"


class StableViews:
    """Records each averager's local shards and update groups after an update, and checks at each
    later update that the engine's views are the same objects and nothing was regrouped."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[list[torch.Tensor], object]] = {}

    def check(self, label: str, averager: WeightAverager) -> None:
        views, groups = averager.strategy.local_shards(), averager.updater.groups
        if label in self.seen:
            old_views, old_groups = self.seen[label]
            changed = [i for i, (a, b) in enumerate(zip(old_views, views)) if a is not b]
            assert not changed, f"{label}: local shards {changed} are new objects although the engine kept them"
            assert groups is old_groups, f"{label}: the update regrouped its tensors"
        self.seen[label] = (views, groups)


def check_a_cast_is_followed(engine: Engine, averager: WeightAverager) -> None:
    """model.to(float64) gives DDP and FSDP2 new local storage: the next update reads it."""
    before = averager.full_state_dict()
    engine.model.to(torch.float64)
    floating = [v for v in averager.strategy.local_shards() if v.is_floating_point()]
    assert {v.dtype for v in floating} == {torch.float64}, {v.dtype for v in floating}
    assert averager.update()
    live = engine.gather_live()
    got = averager.full_state_dict()
    if dist.get_rank() == 0:
        for name in ("embed.weight", "block.up.weight", "gain"):
            want = before[name].lerp(live[name].float(), 0.1)
            torch.testing.assert_close(got[name], want, msg=lambda m, name=name: f"{engine.name}: cast, {name}: {m}")


def check_fsdp1_hands_back_its_list(averager: WeightAverager) -> None:
    """FSDP1 hands back the very list of local shards while nothing in it moved, so the update
    reads no view's pointer; once a buffer's data moves, a new list, and the update follows it."""
    strategy, updater = averager.strategy, averager._state.updater
    handed = strategy.local_shards()
    assert strategy.local_shards() is handed and updater.followed is handed, "FSDP1: a new list with nothing moved"
    (owner, name), *_ = strategy._buffer_slots
    index = len(handed) - len(strategy._buffer_slots)
    was = handed[index].data_ptr()
    owner._buffers[name].data = owner._buffers[name].data.clone()  # the same object, its data elsewhere
    moved = strategy.local_shards()
    assert moved is not handed and moved[index] is handed[index] and moved[index].data_ptr() != was, "FSDP1: unseen"
    updates = averager.num_updates
    averager.update()
    assert averager.num_updates == updates + 1 and updater.followed is moved, "FSDP1: the update did not follow"
    assert all(t.data_ptr() == p for g in updater.groups for t, p in zip(g.live_tensors, g.live_pointers))


def check_logging_is_rank_zero_only(engine: Engine) -> None:
    """The construction message reaches handlers on rank 0 only, unless SHARDAVG_LOG_ALL_RANKS=1."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("shardavg")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        WeightAverager(engine.model)
        by_default = len(records)
        os.environ["SHARDAVG_LOG_ALL_RANKS"] = "1"
        WeightAverager(engine.model)
    finally:
        os.environ.pop("SHARDAVG_LOG_ALL_RANKS", None)
        logger.removeHandler(handler)
    assert by_default == (1 if dist.get_rank() == 0 else 0), f"rank {dist.get_rank()}: {by_default} records"
    assert len(records) - by_default == 1, f"rank {dist.get_rank()}: all ranks asked, {len(records)} records"


@record
def main() -> None:
    engine_kinds = sys.argv[1].split(",")
    harness.init_distributed(deepspeed="zero3" in engine_kinds)
    with harness.CollectiveCount() as sanity:
        dist.all_reduce(torch.ones(1))
    assert sanity.count >= 1, "the collective counter does not see collectives"
    for engine_kind in engine_kinds:
        check_engine(engine_kind)
    harness.finish()


def check_engine(engine_kind: str) -> None:
    """Every configuration of ``engine_kind``: each averager against its reference, then DONE."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if engine_kind == "zero3":
        check_zero_init_dtype_does_not_depend_on_the_cpu()

    for number, build in enumerate(configurations(engine_kind, world)):
        engine = build()
        if number == 0:
            check_logging_is_rank_zero_only(engine)
        check_bad_strategies(engine, engine_kind)
        live = engine.gather_live()
        frozen = {n for n, p in TiedNet().named_parameters() if not p.requires_grad}
        buffer_names = {n for n, _ in TiedNet().named_buffers()}
        plain = TiedNet()
        averagers, references = {}, {}
        for name, (kwargs, reference) in variants().items():
            averagers[name] = WeightAverager(engine.model, **kwargs)
            built = isinstance(reference, (AveragedModel, PlainAverage))
            references[name] = reference if built else AveragedModel(plain, multi_avg_fn=reference)
        if engine.early_averager is not None:  # built before the engine re-allocated its partitions
            averagers["ema_built_early"] = engine.early_averager
            references["ema_built_early"] = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for name, averager in averagers.items():
            assert averager.strategy.name == engine_kind, f"{name}: {averager.strategy.name}"
        harness.check_derived_layout(averagers["ema"])
        several = WeightAverager(
            engine.model, {name: variants()[variant][0]["rule"] for name, variant in SEVERAL.items()}
        )
        collectives: list[str] = []
        stable = StableViews()
        for step in range(1, STEPS + 1):
            engine.step(step)
            with harness.CollectiveCount() as count:
                for averager in averagers.values():
                    averager.update()
                several.update()
            collectives += count.names
            if step > 1:  # the first forward may have set the engine up (FSDP's lazy init)
                for name, averager in averagers.items():
                    stable.check(f"{engine.name}/{name}", averager)
            live = {n: t.float() if t.is_floating_point() else t for n, t in engine.gather_live().items()}
            load_live(plain, live)
            for reference in references.values():
                if isinstance(reference, AveragedModel):
                    reference.update_parameters(plain)
                else:
                    reference.update(step, live, frozen, buffer_names)
            if step == SWAP_AT:
                check_swapped(engine, averagers["ema"], reference_state(references["ema"]))
        assert not collectives, f"{engine.name}: update() issued collectives: {collectives}"

        for name, averager in averagers.items():
            got = averager.full_state_dict()
            assert (got == {}) == (rank != 0), f"{name}: full_state_dict() on rank {rank} has {len(got)} entries"
            reference = references[name]
            want_updates = (
                reference.n_averaged.item() if isinstance(reference, AveragedModel) else reference.num_updates
            )
            assert averager.num_updates == want_updates, f"{name}: {averager.num_updates} updates, want {want_updates}"
            if rank == 0:
                kwargs = variants().get(name, ({},))[0]
                averaged = {n for n in TiedNet().state_dict() if n not in buffer_names and n not in frozen}
                if kwargs.get("include_frozen"):
                    averaged |= frozen
                if kwargs.get("buffers") == "average":
                    averaged |= {n for n, b in TiedNet().named_buffers() if b.is_floating_point()}
                if isinstance(reference, PlainAverage):
                    averaged -= reference.copied
                exact = engine.dtype == torch.float32 or name == "custom_multi_avg_fn"
                check_average(
                    f"{engine.name}/{name}", got, reference_state(references[name]), averaged, engine.dtype, exact
                )

        for name, variant in SEVERAL.items():  # each named average is bitwise its single-average twin
            got, want = several.full_state_dict(name), averagers[variant].full_state_dict()
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), f"several/{name}"
        check_copy_to_gives_every_rank_the_same_average(averagers["ema"], averagers["ema"].full_state_dict())
        harness.check_writers(averagers["ema"], engine.name)
        if number == 0:  # (the live weights go the same way: once per engine)
            harness.check_writers(averagers["ema"], f"{engine.name}-live", live=True)
        ema = averagers["ema"]
        buffers_bytes = sum(b.nbytes for n, b in engine.gather_live().items() if n in buffer_names)
        local_numel = sum(engine.local_param_numels().values())
        expected = local_numel * 4 + buffers_bytes
        assert ema.shadow_bytes() == expected, f"{engine.name}: shadow bytes {ema.shadow_bytes()} != {expected}"
        full = engine.gather_live()
        model_bytes = sum(t.nbytes for n, t in full.items())
        per_rank, local_bytes, kernels = [None] * world, [None] * world, [None] * world
        dist.all_gather_object(per_rank, ema.shadow_bytes())
        dist.all_gather_object(local_bytes, expected)
        groups = ema.updater.groups  # how many tensors one fused kernel call of the update walks
        walked = sum(1 for g in groups for live in g.live_tensors if live.numel())
        dist.all_gather_object(kernels, [sum(len(g.fused_live) for g in groups), walked])
        harness.report(
            "BYTES",
            {
                "engine": engine_kind,
                "config": engine.name,
                "world_size": world,
                "shadow_bytes_per_rank": per_rank,
                "local_shard_bytes_per_rank": local_bytes,
                "fused_and_shards_per_rank": kernels,
                "model_bytes": model_bytes,
            },
        )
        if engine_kind == "fsdp2" and world > 1 and engine.dtype == torch.float32:
            check_update_bn(averagers["ema"], references["ema"])
            check_nonfinite_on_one_rank(engine)
        if engine_kind in ("replicated", "fsdp2") and engine.dtype == torch.float32:
            check_a_cast_is_followed(engine, ema)
        if engine_kind == "fsdp1":
            check_fsdp1_hands_back_its_list(ema)
        dist.barrier()
    harness.report("DONE", {"engine": engine_kind, "world_size": world, "configurations": number + 1})


if __name__ == "__main__":
    main()
