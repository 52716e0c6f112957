"""The Lightning callback under DDP, FSDP, ModelParallel (FSDP2) and DeepSpeed ZeRO-3 at 2 processes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from launcher import Launch, torchrun

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
def launches(tmp_path_factory) -> Callable[[str], list[Launch]]:
    """A strategy's two launches, ``first`` and ``second`` (resuming the first's checkpoint), made
    once. A launch costs more than a part, so the other checks on the same set-up ride along:
    Lightning's own EMA after ``first`` (sharded strategies), the extras after ``second`` (DDP)."""
    made: dict[str, list[Launch]] = {}

    def launched(strategy: str) -> list[Launch]:
        if strategy not in made:
            root = tmp_path_factory.mktemp(strategy)
            first = "first+theirs" if strategy in THEIRS else "first"
            second = "second+extras" if strategy == "ddp" else "second"
            made[strategy] = [torchrun(SCRIPT, 2, mode, strategy, str(root), timeout=420) for mode in (first, second)]
        return made[strategy]

    return launched


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_callback_averages_validates_and_resumes(launches, strategy: str) -> None:
    for mode, launch in zip(("first", "second"), launches(strategy)):
        assert launch.returncode == 0, launch.output[-20000:]
        assert {"mode": mode, "strategy": strategy, "world_size": 2} in launch.reports("LIGHTNING"), launch.output[
            -5000:
        ]


@pytest.mark.parametrize("strategy", sorted(THEIRS))
def test_lightnings_own_ema_fails_on_the_sharded_strategies(launches, strategy: str) -> None:
    launch = launches(strategy)[0]
    outcomes = [r["outcome"] for r in launch.reports("THEIRS")]
    assert outcomes and all(o.startswith(THEIRS[strategy]) for o in outcomes), (outcomes, launch.output[-5000:])
    print(strategy, outcomes[0])


def test_copy_at_end_an_exception_in_validation_and_a_removed_checkpoint(launches) -> None:
    launch = launches("ddp")[1]
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("EXTRAS"), launch.output[-5000:]
