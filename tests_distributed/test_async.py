"""The averager inside one asynchronous DCP save with the model and optimizer (torchrun, CPU, gloo):
updates while the request is in flight change nothing saved; a rank killed while it is in flight
leaves the previous checkpoint loadable and exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import Launch, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_async.py"


@pytest.fixture(scope="module")
def after_a_kill(tmp_path_factory) -> tuple[Path, Launch, dict[int, Launch]]:
    """An FSDP2 run at 2 ranks killed with an asynchronous save in flight; then a launch at 2 and one
    at 4 (resharded) that resume from what it left and go on with the in-flight checks (a launch
    costs more than a mode)."""
    root = tmp_path_factory.mktemp("async")
    killed = torchrun(SCRIPT, 2, "kill", str(root), timeout=300)
    resumed = {
        world_size: torchrun(SCRIPT, world_size, "resume+inflight", str(root), timeout=420) for world_size in (2, 4)
    }
    return root, killed, resumed


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_updates_while_a_save_is_in_flight_change_nothing_it_saves(
    after_a_kill, tmp_path: Path, world_size: int
) -> None:
    launch = after_a_kill[2].get(world_size) or torchrun(SCRIPT, world_size, "inflight", str(tmp_path), timeout=420)
    assert launch.returncode == 0, launch.output[-20000:]
    done = {(r["engine"], r["stager"]) for r in launch.reports("INFLIGHT")}
    assert done == {(e, s) for e in ("replicated", "fsdp2", "fsdp1") for s in ("default", "background")}, done
    assert len(launch.reports("WRITER_STAGER_REFUSED")) == 1


def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint_exact(after_a_kill) -> None:
    root, killed, resumed = after_a_kill
    assert killed.returncode != 0 and killed.reports("KILLING") == [{"rank": 1}], killed.output[-20000:]
    assert "the save completed although" not in killed.output
    assert not (root / "step-6" / ".metadata").exists()  # the request never finished
    for world_size, launch in resumed.items():  # (resharded at 4)
        assert launch.returncode == 0, launch.output[-20000:]
        assert launch.reports("RESUMED") == [{"world_size": world_size}]
