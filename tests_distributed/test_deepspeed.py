"""``shardavg.integrations.deepspeed`` under torchrun: resume at ZeRO 1, 2 and 3, refusals, and a
rank killed in the middle of a save (CPU, gloo)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_deepspeed.py"


def test_resume_is_bitwise_at_every_zero_stage(tmp_path: Path) -> None:
    launch = torchrun(SCRIPT, 2, "resume", str(tmp_path), timeout=420)
    assert launch.returncode == 0, launch.output[-20000:]
    assert {r["stage"] for r in launch.reports("RESUMED")} == {1, 2, 3}, launch.output[-5000:]


def test_a_rank_killed_during_the_save_leaves_latest_on_the_previous_tag(tmp_path: Path) -> None:
    launch = torchrun(SCRIPT, 2, "kill", str(tmp_path), timeout=300)
    assert launch.returncode != 0
    assert f"Signal {int(signal.SIGKILL)} (SIGKILL)" in launch.output, launch.output[-5000:]
    assert (tmp_path / "killed" / "latest").read_text() == "A"
    assert (tmp_path / "killed" / "B").is_dir()  # the engine wrote its part of B; the average never committed
    assert not (tmp_path / "killed" / "B" / "shardavg" / "shardavg.json").exists()
    recovered = torchrun(SCRIPT, 2, "after-kill", str(tmp_path), timeout=300)
    assert recovered.returncode == 0, recovered.output[-20000:]
    assert recovered.reports("RECOVERED"), recovered.output[-5000:]


def test_the_master_source_averages_the_fp32_masters_bitwise(tmp_path: Path) -> None:
    launch = torchrun(SCRIPT, 2, "master", str(tmp_path), timeout=300)
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("MASTER"), launch.output[-5000:]
    measured = {r["stage"]: r["max_rel_difference"] for r in launch.reports("MASTER_VS_LIVE")}
    assert set(measured) == {1, 2, 3}, launch.output[-5000:]
    print("bf16-live average against the fp32-master one, max relative difference by ZeRO stage:", measured)
