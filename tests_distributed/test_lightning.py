"""The Lightning callback under DDP, FSDP, ModelParallel (FSDP2) and DeepSpeed ZeRO-3 at 2 processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_lightning.py"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "model_parallel", "deepspeed"])
def test_the_callback_averages_validates_and_resumes(strategy: str, tmp_path: Path) -> None:
    for mode in ("first", "second"):
        launch = torchrun(SCRIPT, 2, mode, strategy, str(tmp_path), timeout=420)
        assert launch.returncode == 0, launch.output[-20000:]
        assert {"mode": mode, "strategy": strategy, "world_size": 2} in launch.reports("LIGHTNING"), launch.output[
            -5000:
        ]


# What Lightning 2.6's own EMAWeightAveraging does on the same set-ups (the README's claim).
THEIRS = {
    "fsdp": "raised",
    "model_parallel": "raised",
    "deepspeed": "raised",  # every parameter partitioned (at the default threshold a tiny model is not)
}


@pytest.mark.parametrize("strategy", sorted(THEIRS))
def test_lightnings_own_ema_fails_on_the_sharded_strategies(strategy: str, tmp_path: Path) -> None:
    launch = torchrun(SCRIPT, 2, "theirs", strategy, str(tmp_path), timeout=300)
    outcomes = [r["outcome"] for r in launch.reports("THEIRS")]
    assert outcomes and all(o.startswith(THEIRS[strategy]) for o in outcomes), (outcomes, launch.output[-5000:])
    print(strategy, outcomes[0])


def test_copy_at_end_an_exception_in_validation_and_a_removed_checkpoint(tmp_path: Path) -> None:
    launch = torchrun(SCRIPT, 2, "extras", "ddp", str(tmp_path), timeout=300)
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("EXTRAS"), launch.output[-5000:]
