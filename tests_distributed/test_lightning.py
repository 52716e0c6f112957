"""The Lightning callback under DDP, FSDP, ModelParallel (FSDP2) and DeepSpeed ZeRO-3 at 2 processes."""

from __future__ import annotations

import pytest
from launcher import ZERO, Launch, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_lightning.py"
STRATEGIES = ["ddp", "fsdp", "model_parallel", "deepspeed"]

# What Lightning 2.6's own EMAWeightAveraging does on the same set-ups (the README's claim).
THEIRS = {
    "fsdp": "raised",
    "model_parallel": "raised",
    "deepspeed": "raised",  # every parameter partitioned (at the default threshold a tiny model is not)
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Launch]:
    """Two launches, made once: every strategy's ``first``, then every strategy's ``second``
    (resuming the first's checkpoint). A launch, mostly its imports of Lightning, costs more than
    a part, so the other checks ride along: Lightning's own EMA after ``first`` (sharded
    strategies), the extras after ``second`` (DDP), and FSDP's runs again with the checkpoint's
    ``state_dict`` the average (``first-average``, ``second-average``)."""
    root = tmp_path_factory.mktemp("lightning")
    modes = {
        "first": {s: "first+theirs" if s in THEIRS else "first" for s in STRATEGIES},
        "second": {s: "second+extras" if s == "ddp" else "second" for s in STRATEGIES},
    }
    modes["first"]["fsdp"] += "+first-average"
    modes["second"]["fsdp"] += "+second-average"
    plans = {phase: ",".join(f"{s}:{m}" for s, m in by_strategy.items()) for phase, by_strategy in modes.items()}
    return {phase: torchrun(SCRIPT, 2, plan, str(root), timeout=600, preload=ZERO) for phase, plan in plans.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_callback_averages_validates_and_resumes(launches, strategy: str) -> None:
    for mode, launch in launches.items():
        found = [r for r in launch.reports("LIGHTNING") if r["strategy"] == strategy and r["mode"] == mode]
        assert found == [{"mode": mode, "strategy": strategy, "world_size": 2}], launch.output[-20000:]
        assert launch.returncode == 0, launch.output[-20000:]


def test_under_fsdp_a_checkpoint_can_hold_the_average_and_resume_the_live_weights(launches) -> None:
    """``checkpoint_weights="average"``: the distributed checkpoint holds the average's shards where
    the model's were, and a resume goes on from the live weights saved beside it, bitwise."""
    for phase, launch in launches.items():
        mode = f"{phase}-average"
        found = [r for r in launch.reports("LIGHTNING") if r["strategy"] == "fsdp" and r["mode"] == mode]
        assert found == [{"mode": mode, "strategy": "fsdp", "world_size": 2}], launch.output[-20000:]


@pytest.mark.parametrize("strategy", sorted(THEIRS))
def test_lightnings_own_ema_fails_on_the_sharded_strategies(launches, strategy: str) -> None:
    launch = launches["first"]
    outcomes = [r["outcome"] for r in launch.reports("THEIRS") if r["strategy"] == strategy]
    assert outcomes and all(o.startswith(THEIRS[strategy]) for o in outcomes), (outcomes, launch.output[-5000:])
    print(strategy, outcomes[0])


def test_copy_at_end_an_exception_in_validation_and_a_removed_checkpoint(launches) -> None:
    launch = launches["second"]
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("EXTRAS"), launch.output[-5000:]
