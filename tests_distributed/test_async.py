"""The averager inside one asynchronous DCP save with the model and optimizer (torchrun, CPU, gloo):
updates while the request is in flight change nothing saved; a rank killed while it is in flight
leaves the previous checkpoint loadable and exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_async.py"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_updates_while_a_save_is_in_flight_change_nothing_it_saves(tmp_path: Path, world_size: int) -> None:
    launch = torchrun(SCRIPT, world_size, "inflight", str(tmp_path), timeout=420)
    assert launch.returncode == 0, launch.output[-20000:]
    done = {(r["engine"], r["stager"]) for r in launch.reports("INFLIGHT")}
    assert done == {(e, s) for e in ("replicated", "fsdp2", "fsdp1") for s in ("default", "background")}, done
    assert len(launch.reports("WRITER_STAGER_REFUSED")) == 1


def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint_exact(tmp_path: Path) -> None:
    killed = torchrun(SCRIPT, 2, "kill", str(tmp_path), timeout=300)
    assert killed.returncode != 0 and killed.reports("KILLING") == [{"rank": 1}], killed.output[-20000:]
    assert "the save completed although" not in killed.output
    assert not (tmp_path / "step-6" / ".metadata").exists()  # the request never finished
    for world_size in (2, 4):  # (resharded at 4)
        resumed = torchrun(SCRIPT, world_size, "resume", str(tmp_path), timeout=300)
        assert resumed.returncode == 0, resumed.output[-20000:]
        assert resumed.reports("RESUMED") == [{"world_size": world_size}]
