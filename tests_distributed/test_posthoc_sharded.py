"""The post-hoc EMA under torchrun: snapshots written by every engine at 2 and 4 ranks,
synthesized by every engine at 1, 2 and 4 ranks against Algorithm 3 on the full snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_posthoc.py"
ENGINES = {"replicated", "fsdp2", "fsdp1", "zero3"}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("snapshots")
    for world_size in (2, 4):
        launch = torchrun(SCRIPT, world_size, "write", str(root), timeout=420)
        assert launch.returncode == 0, launch.output[-20000:]
        assert {r["engine"] for r in launch.reports("WROTE")} == ENGINES
    return root


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_engine_synthesizes_from_every_engines_snapshots(written: Path, world_size: int) -> None:
    launch = torchrun(SCRIPT, world_size, "read", str(written), timeout=420)
    assert launch.returncode == 0, launch.output[-20000:]
    read = launch.reports("READ")
    assert {r["engine"] for r in read} == ENGINES and all(r["sources"] == 2 * len(ENGINES) for r in read), read
