"""Launch the torchrun scenarios at world sizes 1, 2 and 4 (CPU, gloo) and check their verdicts."""

from __future__ import annotations

import time

import pytest
from launcher import torchrun

ENGINES = ["replicated", "fsdp2", "fsdp1", "zero3"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("engine", ENGINES)
def test_averager_matches_reference(engine: str, world_size: int) -> None:
    launch = torchrun("scenario_averager.py", world_size, engine, timeout=420)
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("DONE") == [{"engine": engine, "world_size": world_size}], launch.output[-5000:]
    for measured in launch.reports("BYTES"):
        assert len(measured["shadow_bytes_per_rank"]) == world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_failing_rank_ends_the_launch_with_its_traceback(world_size: int) -> None:
    started = time.monotonic()
    launch = torchrun("scenario_failure.py", world_size, timeout=120)
    assert launch.returncode != 0
    assert f"ValueError: rank {world_size - 1} fails on purpose" in launch.output
    assert "Traceback" in launch.output
    assert time.monotonic() - started < 90, "the launch lingered after a rank failed"
