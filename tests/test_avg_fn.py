"""``WeightAverager(avg_fn=...)``: torch's per-tensor signature, applied as ``AveragedModel(avg_fn=...)``
applies it (bitwise, fp32, one process), refused where given as the other kind; and the schedules of
issue 60 (``min_decay``, ``HalfLifeFractionEMA``) run by the averager and through a checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import (
    AveragedModel,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
    get_swa_avg_fn,
    get_swa_multi_avg_fn,
)

from shardavg import (
    EMA,
    AvgFnRule,
    CheckpointError,
    CustomRule,
    HalfLifeFractionEMA,
    InverseGammaWarmup,
    RatioWarmup,
    WeightAverager,
)


def alternating(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
    """A hand-written elementwise avg_fn that reads ``num_averaged`` as a tensor, as torch passes it."""
    fast = averaged * 0.75 + current * 0.25
    return torch.where(num_averaged % 2 == 0, fast, averaged + (current - averaged) / (num_averaged + 1))


AVG_FNS = {"ema": get_ema_avg_fn(0.9), "swa": get_swa_avg_fn(), "hand-written": alternating}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: max {(got[name].float() - want[name].float()).abs().max()}"


@pytest.mark.parametrize("which", list(AVG_FNS))
def test_avg_fn_is_bitwise_averaged_model_with_the_same_avg_fn(model, trainer, which) -> None:
    """Every parameter averaged (frozen ones too, as AveragedModel averages them), buffers copied."""
    fn = AVG_FNS[which]
    averager = WeightAverager(model, avg_fn=fn, include_frozen=True)
    reference = AveragedModel(model, avg_fn=fn)
    for _ in range(15):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
        assert_same(averager.full_state_dict(), reference.module.state_dict())
    assert averager.num_updates == 15 and averager.rule == AvgFnRule(fn)


def test_avg_fn_sees_num_averaged_as_averaged_model_passes_it(model, trainer) -> None:
    """A 0-d int64 tensor on the average's device, counting the updates before this one; never
    called at the first update (which copies)."""
    seen: dict[str, list[tuple]] = {"shardavg": [], "torch": []}

    def recording(into: list[tuple]):
        def fn(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
            n = num_averaged
            into.append((type(n), n.dtype, n.device, n.dim(), int(n)))
            return averaged + (current - averaged) / (num_averaged + 1)

        return fn

    averager = WeightAverager(model, avg_fn=recording(seen["shardavg"]))
    reference = AveragedModel(model, avg_fn=recording(seen["torch"]))
    for _ in range(4):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
    assert seen["shardavg"] and set(seen["shardavg"]) == set(seen["torch"])
    assert {call[1:] for call in seen["shardavg"]} == {(torch.int64, torch.device("cpu"), 0, n) for n in (1, 2, 3)}


@pytest.mark.parametrize(
    "fn, factory", [(get_ema_avg_fn(0.999), "get_ema_avg_fn"), (get_swa_avg_fn(), "get_swa_avg_fn")]
)
def test_torchs_per_tensor_fn_given_as_the_rule_is_refused_naming_avg_fn(model, fn, factory) -> None:
    """The issue's case: taken for a multi_avg_fn, it failed inside torch's function at the second update."""
    for rule in (fn, {"ema": fn}):
        with pytest.raises(TypeError, match=r"is a per-tensor avg_fn.*pass it as avg_fn=") as refused:
            WeightAverager(model, rule)
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and factory in message
        assert factory.replace("_avg_fn", "_multi_avg_fn") in message  # the rule= twin, the other fix


def test_a_function_annotated_as_returning_a_tensor_is_refused_as_the_rule(model) -> None:
    def my_ema(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
        return 0.9 * averaged + 0.1 * current

    with pytest.raises(TypeError, match=r"rule=.*my_ema is a per-tensor avg_fn.*pass it as avg_fn="):
        WeightAverager(model, my_ema)
    WeightAverager(model, avg_fn=my_ema)  # where it belongs


def test_an_unannotated_callable_given_as_the_rule_is_still_a_multi_avg_fn(model, trainer) -> None:
    """multi_avg_fn is public API: a function that says nothing of its kind is taken as one."""

    def my_multi(averaged, current, num_averaged):
        torch._foreach_lerp_(averaged, current, 0.2)

    averager = WeightAverager(model, my_multi)
    reference = AveragedModel(model, multi_avg_fn=my_multi)
    assert isinstance(averager.rule, CustomRule)
    for _ in range(3):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
    got, want = averager.full_state_dict(), reference.module.state_dict()
    assert all(torch.equal(got[name], want[name]) for name, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("fn", [get_ema_multi_avg_fn(0.9), get_swa_multi_avg_fn()])
def test_a_multi_avg_fn_given_as_avg_fn_is_refused_naming_rule(model, fn) -> None:
    with pytest.raises(TypeError, match=r"avg_fn=torch\.optim\.swa_utils\.get_\w+_multi_avg_fn.* pass it as rule="):
        WeightAverager(model, avg_fn=fn)


def test_rule_and_avg_fn_are_exclusive_and_avg_fn_must_be_callable(model) -> None:
    with pytest.raises(TypeError, match="give one of rule= and avg_fn=, got both"):
        WeightAverager(model, EMA(decay=0.9), avg_fn=get_ema_avg_fn(0.9))
    with pytest.raises(TypeError, match="avg_fn= must be a callable"):
        WeightAverager(model, avg_fn=0.999)
    assert WeightAverager(model).rule == EMA(decay=0.999)  # neither: the default rule


def test_an_avg_fn_that_returns_nothing_is_refused_with_the_fix(model, trainer) -> None:
    """One that updates in place (a multi_avg_fn's habit) fails in shardavg's code, saying so."""

    def in_place(averaged, current, num_averaged):
        averaged.lerp_(current, 0.1)

    averager = WeightAverager(model, avg_fn=in_place)
    trainer.step()
    averager.update()  # the first update copies: the function is not called
    trainer.step()
    with pytest.raises(TypeError, match=r"avg_fn=.*in_place returned None, not a tensor.*pass it as rule="):
        averager.update()


def test_an_avg_fn_beside_other_averages_in_a_dict(model, trainer) -> None:
    fn = get_swa_avg_fn()
    several = WeightAverager(model, {"ema": EMA(decay=0.9), "swa": AvgFnRule(fn)})
    alone = WeightAverager(model, avg_fn=fn)
    for _ in range(5):
        trainer.step()
        several.update()
        alone.update()
    assert_same(several.full_state_dict("swa"), alone.full_state_dict())


def test_an_avg_fn_average_resumes_from_a_checkpoint(model, trainer, tmp_path) -> None:
    fn = get_ema_avg_fn(0.8)
    averager = WeightAverager(model, avg_fn=fn)
    for _ in range(4):
        trainer.step()
        averager.update()
    averager.save(tmp_path / "avg")
    resumed = WeightAverager(model, avg_fn=fn)
    resumed.load(tmp_path / "avg")
    assert resumed.num_updates == 4
    for _ in range(3):
        trainer.step()
        averager.update()
        resumed.update()
    assert_same(resumed.full_state_dict(), averager.full_state_dict())
    with pytest.raises(CheckpointError, match=r"get_ema_avg_fn.*\(avg_fn\).*get_ema_multi_avg_fn"):
        WeightAverager(model, get_ema_multi_avg_fn(0.8)).load(tmp_path / "avg")  # another rule: refused


def titan_reference(fraction: float, step_bias: int):
    """torchtitan's EMA decay, ``2 ** (-1 / (half_life_fraction * t))``, written from its source, as a
    multi_avg_fn for AveragedModel: update ``t = n + 1 + step_bias`` after ``n`` earlier ones."""

    def update(averaged, current, num_averaged):
        t = int(num_averaged) + 1 + step_bias
        torch._foreach_lerp_(averaged, current, 1.0 - 2.0 ** (-1.0 / (fraction * t)))

    return update


def test_half_life_fraction_averages_as_torchtitans_schedule(model, trainer) -> None:
    averager = WeightAverager(model, HalfLifeFractionEMA(half_life_fraction=0.1, step_bias=3))
    reference = AveragedModel(model, multi_avg_fn=titan_reference(0.1, 3))
    for _ in range(20):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
    got, want = averager.full_state_dict(), reference.module.state_dict()
    assert all(torch.equal(got[name], want[name]) for name, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "rule, other",
    [
        (HalfLifeFractionEMA(half_life_fraction=0.05, step_bias=19), HalfLifeFractionEMA(half_life_fraction=0.05)),
        (
            EMA(decay=0.99, warmup=InverseGammaWarmup(power=0.75, min_decay=0.5)),
            EMA(decay=0.99, warmup=InverseGammaWarmup(power=0.75)),
        ),
        (EMA(decay=0.99, warmup=RatioWarmup(min_decay=0.3)), EMA(decay=0.99, warmup=RatioWarmup())),
    ],
)
def test_the_new_rules_round_trip_through_a_checkpoint_and_another_is_refused(model, trainer, tmp_path, rule, other):
    averager = WeightAverager(model, rule)
    for _ in range(5):
        trainer.step()
        averager.update()
    averager.save(tmp_path / "avg")
    resumed = WeightAverager(model, rule)
    resumed.load(tmp_path / "avg")
    assert resumed.rule == rule and resumed.num_updates == 5
    for _ in range(3):
        trainer.step()
        averager.update()
        resumed.update()
    assert_same(resumed.full_state_dict(), averager.full_state_dict())
    with pytest.raises(CheckpointError, match="with rule"):
        WeightAverager(model, other).load(tmp_path / "avg")


def test_a_warmup_floor_changes_the_average_as_timm_does(model, trainer) -> None:
    """min_decay=0.6 over a ramp that starts at 0.41: the floor holds the early updates, then the ramp."""
    floored = WeightAverager(model, EMA(decay=0.95, warmup=InverseGammaWarmup(power=0.75, min_decay=0.6)))
    reference: dict[str, torch.Tensor] = {}
    for n in range(10):
        trainer.step()
        floored.update()
        decay = max(min(0.95, 1 - (1 + n) ** -0.75), 0.6)  # timm's get_decay at its step n + 1
        for name, p in model.named_parameters():
            if p.requires_grad:
                reference[name] = p.detach().clone() if n == 0 else reference[name].lerp_(p.detach(), 1 - decay)
    got = floored.full_state_dict()
    assert all(torch.equal(got[name], value) for name, value in reference.items())
