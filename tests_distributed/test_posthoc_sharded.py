"""The post-hoc EMA under torchrun: snapshots written by every engine at 2 and 4 ranks,
synthesized by every engine at 1, 2 and 4 ranks against Algorithm 3 on the full snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import ZERO, Launch, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_posthoc.py"
ENGINES = {"replicated", "fsdp2", "fsdp1", "zero3"}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Launch]:
    """Every engine's snapshots at 2 and 4 ranks; the launch at 4 then reads them all (a launch
    costs more than a mode), and that launch is returned for the test at 4."""
    root = tmp_path_factory.mktemp("snapshots")
    for world_size, modes in ((2, "write"), (4, "write+read")):
        launch = torchrun(SCRIPT, world_size, modes, str(root), timeout=420, preload=ZERO)
        assert launch.returncode == 0, launch.output[-20000:]
        assert {r["engine"] for r in launch.reports("WROTE")} == ENGINES
    return root, launch


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_engine_synthesizes_from_every_engines_snapshots(written, world_size: int) -> None:
    root, read_at_four = written
    launch = (
        read_at_four if world_size == 4 else torchrun(SCRIPT, world_size, "read", str(root), timeout=420, preload=ZERO)
    )
    assert launch.returncode == 0, launch.output[-20000:]
    read = launch.reports("READ")
    assert {r["engine"] for r in read} == ENGINES and all(r["sources"] == 2 * len(ENGINES) for r in read), read
