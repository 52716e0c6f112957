"""Numbers at the edges of their range, thrown at every place a number enters: each builds
something that works (every weight a finite number in [0, 1]) or is refused in one line naming
the argument. Never another exception, an overflow, a LAPACK crash, or a traceback from the CLI."""

from __future__ import annotations

import decimal
import json
import math
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import TiedNet
from helpers import deadline

from shardavg import EMA, CheckpointError, InverseGammaWarmup, PostHocEMA, PowerEMA, rule_from_config
from shardavg.checkpoints.description import with_checksum
from shardavg.cli import main as cli_main
from shardavg.posthoc import profile_dot, snapshots, synthesize, target_gamma

BOUNDS = (0.0, 1.0, -1.0, -0.5, 0.3003, 0.2981, 1e-6, 1e6, 1e16, 1.25e16)
EDGES = [
    *BOUNDS,
    *(math.nextafter(b, math.inf) for b in BOUNDS),
    *(math.nextafter(b, -math.inf) for b in BOUNDS),
    -0.0, 5e-324, -5e-324, 1e-310, 1e-300, 1e-200, 1e-12, 1e-7, 0.05, 0.5, 0.9, 0.999, 1 - 1e-16, 2.0, 3,
    7, 1e3, 1e9, 1e100, 1e300, 1.7976931348623157e308, -1e300, math.inf, -math.inf, math.nan,
    True, False, np.float32(0.9), np.float64(0.05), np.int64(5), np.float16(0.1), Fraction(1, 3),
    10**400, -(10**400), 2**1024 - 1, "0.9", "", None, [0.9], {}, complex(0.9, 0),
]  # fmt: skip
UPDATES = (1, 2, 3, 10, 1000, 10**6, 10**9)


def works(rule) -> bool:
    """Every weight a finite number in [0, 1], over a billion updates."""
    return all(math.isfinite(w := rule.weight(n)) and 0.0 <= w <= 1.0 for n in UPDATES)


def one_line_refusal(error: BaseException) -> bool:
    return isinstance(error, (ValueError, TypeError)) and len(str(error).splitlines()) == 1 and len(str(error)) < 400


BUILDERS = {
    "EMA(decay=)": lambda v: EMA(decay=v),
    "EMA(half_life=)": lambda v: EMA(half_life=v),
    "InverseGammaWarmup(inv_gamma=)": lambda v: EMA(decay=0.999, warmup=InverseGammaWarmup(inv_gamma=v)),
    "InverseGammaWarmup(power=)": lambda v: EMA(decay=0.999, warmup=InverseGammaWarmup(power=v)),
    "PowerEMA(gamma=)": lambda v: PowerEMA(gamma=v),
    "PowerEMA(sigma_rel=)": lambda v: PowerEMA(sigma_rel=v),
    "config ema decay": lambda v: rule_from_config({"kind": "ema", "decay": v, "warmup": None}),
    "config warm-up": lambda v: rule_from_config(
        {"kind": "ema", "decay": 0.99, "warmup": {"kind": "inverse_gamma", "inv_gamma": v, "power": 0.75}}
    ),
    "config power_ema": lambda v: rule_from_config({"kind": "power_ema", "sigma_rel": v}),
}


@pytest.mark.parametrize("what", list(BUILDERS))
def test_every_rule_number_builds_a_working_rule_or_is_refused_in_one_line(what) -> None:
    outcomes: Counter[str] = Counter()
    for value in EDGES:
        try:
            rule = BUILDERS[what](value)
        except Exception as error:  # noqa: BLE001 - the test is which ones
            assert one_line_refusal(error), f"{what} {value!r}: {type(error).__name__}: {error}"
            outcomes["refused"] += 1
            continue
        assert works(rule), f"{what} {value!r} built {rule!r}, whose weights are not all in [0, 1]"
        outcomes["built"] += 1
    assert outcomes["built"] >= 5 and outcomes["refused"] >= 20, outcomes


def test_the_issue_cases_are_refused_with_the_range_that_works() -> None:
    with pytest.raises(ValueError, match=r"sigma_rel must be in \[1e-06, 0.3003\) .* got 1e-200"):
        PowerEMA(sigma_rel=1e-200)
    with pytest.raises(ValueError, match=r"config key|sigma_rel must be in \[1e-06"):
        rule_from_config({"kind": "power_ema", "sigma_rel": 1e-200})
    with pytest.raises(ValueError, match=r"half_life must be > 0 updates and at most 1e\+16 .* never moves"):
        EMA(half_life=1e17)
    assert EMA(half_life=1e16).weight(1) > 0  # still moves: the largest accepted half-life
    with pytest.raises(ValueError, match=r"EMA: decay must be a finite number, got 1000000000000"):
        EMA(decay=10**400)
    with pytest.raises(ValueError, match="gamma -0.999999 is too wide for post-hoc EMA: a profile needs gamma > -0.5"):
        target_gamma(gamma=-0.999999)
    assert PowerEMA(gamma=-0.999999).weight(2) == pytest.approx(1 - (2 / 3) ** 1e-6)  # a valid EMA, not a profile


def test_post_hoc_profiles_whose_inner_products_do_not_exist_are_refused(tmp_path) -> None:
    model = TiedNet()
    for profiles in ({"gammas": (-0.999999, 5.0)}, {"gammas": (-0.5, 5.0)}, {"gammas": (3.0, -0.75)}):
        with pytest.raises(ValueError, match="too wide for post-hoc EMA"):
            PostHocEMA(model, **profiles, snapshot_every=1, directory=tmp_path / "never")
    for bad in ({"sigma_rels": "0.05"}, {"sigma_rels": (0.05, math.nan)}, {"gammas": (3, 10**400)}):
        with pytest.raises(ValueError, match="PostHocEMA|finite number"):
            PostHocEMA(model, **bad, snapshot_every=1, directory=tmp_path / "never")
    with pytest.raises(ValueError, match="snapshot_dtype must be a floating torch.dtype"):
        PostHocEMA(model, snapshot_every=1, directory=tmp_path / "never", snapshot_dtype=torch.int8)
    assert not (tmp_path / "never").exists()


@pytest.fixture
def snapshot_folder(trainer, tmp_path) -> Path:
    posthoc = PostHocEMA(trainer.model, sigma_rels=(0.05, 0.10), snapshot_every=2, directory=tmp_path / "snaps")
    for _ in range(6):
        trainer.step()
        posthoc.update()
    return tmp_path / "snaps"


def cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    with deadline(30):
        code = cli_main(list(args))
    return code, capsys.readouterr().err


def test_a_snapshot_at_t_zero_or_with_a_profile_that_has_no_inner_product_is_named(snapshot_folder, capsys) -> None:
    for label, change in (
        ("t 0", lambda meta: meta.update(num_updates=0)),
        ("gamma -0.9", lambda meta: meta["averages"][0].update(rule={"kind": "power_ema", "gamma": -0.9})),
    ):
        manifest = snapshot_folder / "snapshot-000000002" / "shardavg.json"
        original = manifest.read_text()
        meta = json.loads(original)
        meta.pop("checksum")
        change(meta)
        manifest.write_text(json.dumps(with_checksum(meta)))  # as someone who knows the format
        with pytest.raises(CheckpointError, match="snapshot-000000002"):
            snapshots(snapshot_folder)
        with pytest.raises(CheckpointError, match="snapshot-000000002"):
            synthesize(TiedNet(), snapshot_folder, 0.07)
        code, said = cli(capsys, "posthoc", str(snapshot_folder), "--list")
        assert code == 2 and said.startswith("shardavg: error:") and len(said.strip().splitlines()) == 1, (label, said)
        manifest.write_text(original)


def test_every_cli_number_is_synthesized_or_refused_in_one_line(snapshot_folder, tmp_path, capsys) -> None:
    outcomes: Counter[str] = Counter()
    for case, value in enumerate(EDGES):
        for option in ("--sigma-rel", "--step"):
            args = ["posthoc", str(snapshot_folder), str(tmp_path / f"out-{case}{option}"), option, str(value)]
            if option == "--step":
                args += ["--sigma-rel", "0.07"]
            code, said = cli(capsys, *args)
            if code == 0:
                outcomes["written"] += 1
                continue
            assert code == 2 and said.startswith("shardavg: error:") and len(said.strip().splitlines()) == 1, said
            outcomes["refused"] += 1
    print(dict(outcomes))
    assert outcomes["written"] >= 3 and outcomes["refused"] >= 60, outcomes


def precise_profile_dot(t_a: int, gamma_a: float, t_b: int, gamma_b: float) -> float:
    """The closed form in 60-digit decimal arithmetic (the gammas as the floats they are)."""
    with decimal.localcontext() as context:
        context.prec = 60
        ga, gb, m = Decimal(gamma_a), Decimal(gamma_b), Decimal(min(t_a, t_b))
        value = (ga + 1) * (gb + 1) / (ga + gb + 1) / m
        value *= (m / Decimal(t_a)) ** (ga + 1) * (m / Decimal(t_b)) ** (gb + 1)
        return float(value)


def test_inner_products_stay_accurate_for_large_gamma_and_t() -> None:
    """Against 60-digit arithmetic, the float64 evaluation agrees to 1e-9 relative even where the
    powers are huge (the old grouping, which cancelled terms of size gamma * log t, lost up to
    six digits at gamma 1e6, t 1e9)."""
    cases = [
        (10**9, 10**9 - 1000, 999_999.0, 3.0),
        (10**6, 10**6, 1e5, 1e5),
        (5, 10**9, 7.0, 1.0),
        (10**9, 10**9, 1e6, 1e6),
    ]
    for t_a, t_b, g_a, g_b in cases:
        inputs = [torch.tensor(float(x), dtype=torch.float64) for x in (t_a, g_a, t_b, g_b)]
        got = float(profile_dot(*inputs))
        assert got == pytest.approx(precise_profile_dot(t_a, g_a, t_b, g_b), rel=1e-9, abs=1e-300), (t_a, t_b, g_a, g_b)
