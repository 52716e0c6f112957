"""Averaging rules: their weights, their validation messages and their plain-data form."""

from __future__ import annotations

import math
import pickle

import pytest
from torch.optim.swa_utils import get_ema_multi_avg_fn

from shardavg import EMA, SWA, CustomRule, InverseGammaWarmup, PowerEMA, RatioWarmup, rule_from_config
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
