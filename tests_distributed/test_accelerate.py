"""``shardavg.integrations.accelerate`` under real accelerate launches on CPU: train with
gradient accumulation, ``save_state``, and ``load_state`` in a new launch (same and other world
size), the averages bitwise those of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import ZERO, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_accelerate.py"
ON_CPU = {"ACCELERATE_USE_CPU": "true"}  # under torchrun accelerate sees one process without it


def launch(mode: str, kind: str, root: Path, world_size: int, env: dict) -> None:
    zero = ZERO if kind == "deepspeed" else ()
    result = torchrun(SCRIPT, world_size, mode, kind, str(root), timeout=300, env=env, preload=zero)
    assert result.returncode == 0, result.output[-20000:]
    (done,) = [r for r in result.reports("DONE") if r["mode"] == mode][:1]
    assert done == {"mode": mode, "kind": kind, "world_size": world_size}, done


def test_multi_cpu_save_state_and_load_state_at_the_same_and_another_world_size(tmp_path: Path) -> None:
    launch("first", "ddp", tmp_path, 2, ON_CPU)
    assert (tmp_path / "checkpoint" / "shardavg" / "shardavg.json").is_file()
    launch("second", "ddp", tmp_path, 2, ON_CPU)
    launch("other", "ddp", tmp_path, 1, ON_CPU)


def test_deepspeed_zero3_save_state_and_load_state(tmp_path: Path) -> None:
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}  # (not ACCELERATE_USE_CPU: it turns the plugin off)
    launch("first", "deepspeed", tmp_path, 2, env)
    assert (tmp_path / "checkpoint" / "pytorch_model").is_dir()  # the engine's own checkpoint beside ours
    launch("second", "deepspeed", tmp_path, 2, env)
