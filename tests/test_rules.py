"""Averaging rules: their weights, their validation messages and their plain-data form."""

from __future__ import annotations

import json
import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
from torch.optim.swa_utils import get_ema_avg_fn, get_ema_multi_avg_fn

from shardavg import (
    EMA,
    SWA,
    AvgFnRule,
    CustomRule,
    HalfLifeFractionEMA,
    InverseGammaWarmup,
    PowerEMA,
    RatioWarmup,
    Rule,
    rule_from_config,
)
from shardavg.rules import as_rule, gamma_to_sigma_rel, sigma_rel_to_gamma


@pytest.mark.parametrize("decay", [0, 1, 1.0, -0.5, 1.5])
def test_ema_decay_outside_open_unit_interval_is_refused(decay: float) -> None:
    with pytest.raises(ValueError, match=r"EMA decay must be in the open interval \(0, 1\), got"):
        EMA(decay=decay)


@pytest.mark.parametrize("decay", [float("nan"), float("inf"), True, "0.9", None])
def test_ema_decay_must_be_a_finite_number(decay: object) -> None:
    with pytest.raises(ValueError, match="EMA"):
        EMA(decay=decay)


def test_ema_takes_exactly_one_of_decay_and_half_life() -> None:
    with pytest.raises(ValueError, match="exactly one of decay= or half_life=, got both"):
        EMA(decay=0.9, half_life=10)
    with pytest.raises(ValueError, match="exactly one of decay= or half_life=, got neither"):
        EMA()
    with pytest.raises(ValueError, match="half_life must be > 0 updates"):
        EMA(half_life=0)


def test_half_life_halves_an_old_weight_after_that_many_updates() -> None:
    rule = EMA(half_life=10)
    assert rule.target_decay**10 == pytest.approx(0.5, rel=1e-12)
    assert rule.weight(5) == pytest.approx(1 - 0.5 ** (1 / 10), rel=1e-15)


def test_ema_weight_is_one_minus_decay_as_torch_computes_it() -> None:
    assert EMA(decay=0.999).weight(1) == 1 - 0.999
    assert EMA(decay=0.999).weight(10_000) == 1 - 0.999


def test_inverse_gamma_warmup_ramps_up_and_is_capped_at_decay() -> None:
    rule = EMA(decay=0.99, warmup=InverseGammaWarmup(inv_gamma=1.0, power=2 / 3))
    assert rule.weight(1) == 1 - (1 - 2 ** (-2 / 3))
    weights = [rule.weight(n) for n in range(1, 100_000, 997)]
    assert all(a >= b for a, b in zip(weights, weights[1:]))
    assert rule.weight(10**9) == 1 - 0.99


def test_ratio_warmup_is_one_plus_t_over_ten_plus_t() -> None:
    rule = EMA(decay=0.9999, warmup=RatioWarmup())
    assert rule.weight(1) == 1 - 2 / 11
    assert rule.weight(90) == 1 - 91 / 100
    assert EMA(decay=0.5, warmup=RatioWarmup()).weight(90) == 0.5


def test_warmup_must_be_a_warmup_object() -> None:
    with pytest.raises(TypeError, match="InverseGammaWarmup"):
        EMA(decay=0.9, warmup="inverse_gamma")
    with pytest.raises(ValueError, match="inv_gamma must be > 0"):
        InverseGammaWarmup(inv_gamma=0)
    with pytest.raises(ValueError, match="power must be > 0"):
        InverseGammaWarmup(power=-1)


def test_swa_is_the_running_mean() -> None:
    assert [SWA().weight(n) for n in (1, 2, 3)] == [1 / 2, 1 / 3, 1 / 4]


def test_power_ema_matches_edm2() -> None:
    # EDM2 (Karras et al. 2024), table of sigma_rel -> gamma: 0.05 -> 16.97, 0.10 -> 6.94
    assert PowerEMA(sigma_rel=0.05).exponent == pytest.approx(16.97, abs=5e-3)
    assert PowerEMA(sigma_rel=0.10).exponent == pytest.approx(6.94, abs=5e-3)
    for sigma in (0.02, 0.05, 0.1, 0.2, 0.28):
        assert gamma_to_sigma_rel(sigma_rel_to_gamma(sigma)) == pytest.approx(sigma, rel=1e-10)
    gamma = 6.94
    for n in (1, 5, 50):
        t = n + 1
        assert PowerEMA(gamma=gamma).weight(n) == 1 - (1 - 1 / t) ** (gamma + 1)


def test_power_ema_with_gamma_zero_is_swa() -> None:
    for n in (1, 2, 10, 1000):
        assert PowerEMA(gamma=0).weight(n) == pytest.approx(SWA().weight(n), rel=1e-12)


def test_power_ema_validation() -> None:
    with pytest.raises(ValueError, match="exactly one of gamma= or sigma_rel=, got both"):
        PowerEMA(gamma=7, sigma_rel=0.1)
    with pytest.raises(ValueError, match="got neither"):
        PowerEMA()
    for gamma in (-1, 1e6 + 1, 1e300):
        with pytest.raises(ValueError, match="gamma must be > -1 and at most 1e.06"):
            PowerEMA(gamma=gamma)
    for sigma in (0, -0.1, 0.31, 1.0, 1e-200, 9.9e-7):
        with pytest.raises(ValueError, match=r"sigma_rel must be in \[1e-06, 0.3003\)"):
            PowerEMA(sigma_rel=sigma)


@pytest.mark.parametrize(
    "rule",
    [
        EMA(decay=0.999),
        EMA(half_life=250.0),
        EMA(decay=0.9999, warmup=InverseGammaWarmup(inv_gamma=1.0, power=0.75)),
        EMA(decay=0.9999, warmup=RatioWarmup()),
        SWA(),
        PowerEMA(gamma=6.94),
        PowerEMA(sigma_rel=0.05),
    ],
)
def test_rules_are_plain_data_and_picklable(rule) -> None:
    config = rule.to_config()
    assert rule_from_config(config) == rule
    assert pickle.loads(pickle.dumps(rule)) == rule
    assert all(isinstance(v, (str, float, dict, type(None))) for v in config.values())


def test_rule_from_config_refuses_unknown_and_custom_kinds() -> None:
    with pytest.raises(ValueError, match="unknown rule kind 'polyak'"):
        rule_from_config({"kind": "polyak"})
    with pytest.raises(ValueError, match="custom callable"):
        rule_from_config(CustomRule(get_ema_multi_avg_fn(0.9)).to_config())


def test_any_multi_avg_fn_callable_is_a_rule() -> None:
    fn = get_ema_multi_avg_fn(0.9)
    rule = as_rule(fn)
    assert isinstance(rule, CustomRule) and rule.fn is fn
    assert rule.to_config() == {
        "kind": "custom",
        "name": "torch.optim.swa_utils.get_ema_multi_avg_fn.<locals>.ema_update",
    }
    with pytest.raises(TypeError, match="rule must be EMA"):
        as_rule(0.999)
    with pytest.raises(TypeError, match="is a warm-up, not a rule"):
        as_rule(RatioWarmup())


def test_weights_are_in_unit_interval() -> None:
    for rule in (EMA(decay=0.9), SWA(), PowerEMA(sigma_rel=0.1), EMA(half_life=3, warmup=RatioWarmup())):
        for n in range(1, 200):
            assert 0 < rule.weight(n) <= 1 and math.isfinite(rule.weight(n))


# --------------------------------------------------------------------------- issue 60: the peers' schedules


def timm_decay(step: int, decay: float, inv_gamma: float, power: float, min_decay: float) -> float:
    """timm's ModelEmaV3.get_decay (update_after_step 0, warm-up on), written from its source: ``step``
    is the optimizer step of the update, 1 for the first."""
    step = max(0, step - 1)
    if step <= 0:
        return 0.0
    return max(min(1 - (1 + step / inv_gamma) ** -power, decay), min_decay)


def ema_pytorch_decay(step: int, beta: float, inv_gamma: float, power: float, min_value: float) -> float:
    """ema-pytorch's EMA.get_current_decay (update_after_step 0), written from its source: a clamp of
    the ramp between ``min_value`` and ``beta``."""
    epoch = max(step - 1, 0)
    if epoch <= 0:
        return 0.0
    return min(max(1 - (1 + epoch / inv_gamma) ** -power, min_value), beta)


@pytest.mark.parametrize("min_decay", [0.0, 0.3, 0.6, 0.9, 0.9999])
def test_min_decay_floors_the_warmup_as_timm_and_ema_pytorch_do(min_decay: float) -> None:
    """The update after ``n`` earlier ones is timm's step ``n + 1``; the first update copies in all three."""
    rule = EMA(decay=0.9999, warmup=InverseGammaWarmup(inv_gamma=3.0, power=0.75, min_decay=min_decay))
    for n in (*range(1, 200), 10**4, 10**6, 10**9):
        assert rule.weight(n) == 1.0 - timm_decay(n + 1, 0.9999, 3.0, 0.75, min_decay)
        assert 1.0 - rule.weight(n) == pytest.approx(ema_pytorch_decay(n + 1, 0.9999, 3.0, 0.75, min_decay), abs=1e-15)
    assert timm_decay(1, 0.9999, 3.0, 0.75, min_decay) == 0.0  # the peers' first update copies, as ours does


def test_min_decay_floors_the_ratio_warmup_too() -> None:
    rule = EMA(decay=0.999, warmup=RatioWarmup(min_decay=0.5))
    assert [rule.weight(n) for n in (1, 8, 9, 10)] == [1 - 0.5, 1 - 0.5, 1 - 10 / 19, 1 - 11 / 20]
    assert rule.weight(10**9) == 1 - 0.999


def test_min_decay_is_checked() -> None:
    for bad in (-0.1, 1.0, 1.5, math.nan, math.inf, True, "0.5", None):
        with pytest.raises(ValueError, match="min_decay must be") as refused:
            InverseGammaWarmup(min_decay=bad)
        assert len(str(refused.value).splitlines()) == 1
        with pytest.raises(ValueError, match="RatioWarmup: min_decay must be"):
            RatioWarmup(min_decay=bad)
    with pytest.raises(ValueError, match=r"min_decay 0\.9999 is above the decay 0\.999"):
        EMA(decay=0.999, warmup=InverseGammaWarmup(min_decay=0.9999))
    assert EMA(decay=0.999, warmup=RatioWarmup(min_decay=0.999)).weight(1) == 1 - 0.999  # the floor at the decay
    assert InverseGammaWarmup(min_decay=np.float32(0.5)).min_decay == 0.5
    assert type(InverseGammaWarmup(min_decay=Fraction(1, 2)).min_decay) is float


def test_a_warmup_without_a_floor_keeps_the_config_it_had() -> None:
    """Checkpoints saved before warm-ups had floors hold configs without "min_decay": they still
    build the same rule and compare equal."""
    old = {"kind": "ema", "decay": 0.99, "warmup": {"kind": "inverse_gamma", "inv_gamma": 1.0, "power": 0.75}}
    assert rule_from_config(old).to_config() == old and Rule.from_json(old, "here") == rule_from_config(old)
    assert RatioWarmup().to_config() == {"kind": "ratio"}
    floored = EMA(decay=0.99, warmup=RatioWarmup(min_decay=0.25))
    assert floored.to_config()["warmup"] == {"kind": "ratio", "min_decay": 0.25}
    assert rule_from_config(json.loads(json.dumps(floored.to_config()))) == floored


def titan_decay(half_life_fraction: float, num_updates: int) -> float:
    """torchtitan's ``EMAOptimizersContainer._decay_at`` (torchtitan/components/ema.py), independently:
    the decay whose half-life is ``half_life_fraction * num_updates`` updates."""
    return math.exp(-math.log(2.0) / (half_life_fraction * num_updates))


@pytest.mark.parametrize("fraction, bias", [(0.05, 0), (0.1, 3), (1.0, 0), (0.05, 19), (1e-3, 10**6)])
def test_half_life_fraction_is_torchtitans_schedule(fraction: float, bias: int) -> None:
    rule = HalfLifeFractionEMA(half_life_fraction=fraction, step_bias=bias)
    for n in (*range(1, 300), 10**5, 10**9):
        t = n + 1 + bias
        assert 1.0 - rule.weight(n) == pytest.approx(titan_decay(fraction, t), rel=1e-12, abs=1e-15)
        assert rule.weight(n) == 1.0 - 2.0 ** (-1.0 / (fraction * t))  # torchtitan's own expression, bitwise


def test_half_life_fraction_halves_at_the_fraction_and_counts_the_bias() -> None:
    assert HalfLifeFractionEMA().weight(19) == 0.5  # update 20 at the default 0.05: a half-life of one update
    assert HalfLifeFractionEMA(step_bias=19).weight(1) == HalfLifeFractionEMA().weight(20)
    rule = HalfLifeFractionEMA(half_life_fraction=0.25)
    for t in (4, 40, 400, 4000):  # after half_life_fraction * t updates at that decay, an old weight counts half
        assert (1.0 - rule.weight(t - 1)) ** (0.25 * t) == pytest.approx(0.5, rel=1e-12)
    weights = [rule.weight(n) for n in range(1, 10_000, 37)]
    assert all(a > b > 0 for a, b in zip(weights, weights[1:]))  # the average slows as the run grows


def test_half_life_fraction_is_checked() -> None:
    for bad in (0, 0.0, -0.05, 1.0000001, 2, math.nan, math.inf, True, "0.05", None):
        with pytest.raises(ValueError, match=r"half_life_fraction must be") as refused:
            HalfLifeFractionEMA(half_life_fraction=bad)
        assert len(str(refused.value).splitlines()) == 1
    for bad in (-1, 1.0, 0.5, True, "3", None, 10**15 + 1, math.nan):
        with pytest.raises(ValueError, match=r"step_bias must be an int in \[0, 1e\+15\]"):
            HalfLifeFractionEMA(step_bias=bad)
    assert HalfLifeFractionEMA(step_bias=np.int64(7)).step_bias == 7
    assert type(HalfLifeFractionEMA(step_bias=np.int64(7)).step_bias) is int
    extreme = HalfLifeFractionEMA(half_life_fraction=1.0, step_bias=10**15)
    assert all(0.0 < extreme.weight(n) <= 1.0 for n in (1, 10**9))  # still moves at the largest bias
    tiny = HalfLifeFractionEMA(half_life_fraction=5e-324)
    assert all(tiny.weight(n) == 1.0 for n in (1, 10**9))  # a half-life of nothing: each update copies


@pytest.mark.parametrize(
    "rule",
    [
        HalfLifeFractionEMA(),
        HalfLifeFractionEMA(half_life_fraction=0.2, step_bias=19),
        EMA(decay=0.99, warmup=InverseGammaWarmup(inv_gamma=2.0, power=0.75, min_decay=0.5)),
        EMA(half_life=50, warmup=RatioWarmup(min_decay=0.1)),
    ],
)
def test_the_new_rules_are_plain_data_through_json(rule) -> None:
    """As a description records them (to_json, JSON text, Rule.from_json) and as YAML gives them."""
    text = json.dumps(rule.to_json())
    assert Rule.from_json(json.loads(text), "here") == rule
    assert rule_from_config(rule.to_config()) == rule
    assert pickle.loads(pickle.dumps(rule)) == rule


def test_half_life_fraction_config_is_checked() -> None:
    with pytest.raises(ValueError, match="half_life_fraction must be a finite number, got None"):
        rule_from_config({"kind": "half_life_fraction", "step_bias": 0})
    with pytest.raises(ValueError, match="step_bias must be an int"):
        rule_from_config({"kind": "half_life_fraction", "half_life_fraction": 0.05, "step_bias": 2.0})


def test_a_per_tensor_avg_fn_is_its_own_rule_and_refused_as_a_multi_avg_fn() -> None:
    fn = get_ema_avg_fn(0.9)
    rule = AvgFnRule(fn)
    assert rule == AvgFnRule(fn) and rule != AvgFnRule(get_ema_avg_fn(0.9))
    assert rule != CustomRule(get_ema_multi_avg_fn())
    name = "torch.optim.swa_utils.get_ema_avg_fn.<locals>.ema_update (avg_fn)"
    assert rule.to_config() == {"kind": "custom", "name": name}
    assert Rule.from_json(rule.to_json(), "here") is None  # recorded as a custom rule: not rebuilt from its name
    for wrapped in (lambda: as_rule(fn), lambda: CustomRule(fn)):
        with pytest.raises(TypeError, match=r"per-tensor avg_fn.*pass it as avg_fn=.*get_ema_multi_avg_fn"):
            wrapped()
    with pytest.raises(TypeError, match="is a multi_avg_fn"):
        AvgFnRule(get_ema_multi_avg_fn(0.9))
