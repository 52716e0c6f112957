"""``shardavg.integrations.deepspeed`` under torchrun: resume at ZeRO 1, 2 and 3, refusals, a rank
killed in the middle of a save, the fp32 masters and ZeRO-3 offload to the CPU (CPU, gloo)."""

from __future__ import annotations

import signal

import pytest
from launcher import ZERO, Launch, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_deepspeed.py"


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> tuple[dict, Launch, Launch]:
    """A launch whose rank 1 is killed in the middle of a save; then one launch that recovers from
    it and goes on with the resume, master and offload checks (a launch costs more than a mode)."""
    root = tmp_path_factory.mktemp("deepspeed")
    killed = torchrun(SCRIPT, 2, "kill", str(root), timeout=300, forked=False)  # (launcher.torchrun: why)
    left = {"latest": (root / "killed" / "latest").read_text() if (root / "killed" / "latest").exists() else None,
            "B": (root / "killed" / "B").is_dir(),
            "B committed": (root / "killed" / "B" / "shardavg" / "shardavg.json").exists()}  # fmt: skip
    after = torchrun(SCRIPT, 2, "after-kill+resume+master+offload", str(root), timeout=600, preload=ZERO)
    return left, killed, after


def test_resume_is_bitwise_at_every_zero_stage(launches) -> None:
    launch = launches[2]
    assert launch.returncode == 0, launch.output[-20000:]
    assert {r["stage"] for r in launch.reports("RESUMED")} == {1, 2, 3}, launch.output[-5000:]


def test_a_rank_killed_during_the_save_leaves_latest_on_the_previous_tag(launches) -> None:
    left, launch, recovered = launches
    assert launch.returncode != 0
    assert f"Signal {int(signal.SIGKILL)} (SIGKILL)" in launch.output, launch.output[-5000:]
    assert left["latest"] == "A"
    assert left["B"]  # the engine wrote its part of B; the average never committed
    assert not left["B committed"]
    assert recovered.returncode == 0, recovered.output[-20000:]
    assert recovered.reports("RECOVERED"), recovered.output[-5000:]


def test_the_master_source_averages_the_fp32_masters_bitwise(launches) -> None:
    launch = launches[2]
    assert launch.returncode == 0, launch.output[-20000:]
    assert launch.reports("MASTER"), launch.output[-5000:]
    measured = {r["stage"]: r["max_rel_difference"] for r in launch.reports("MASTER_VS_LIVE")}
    assert set(measured) == {1, 2, 3}, launch.output[-5000:]
    print("bf16-live average against the fp32-master one, max relative difference by ZeRO stage:", measured)


def test_zero3_offloaded_to_the_cpu_is_averaged_bitwise_and_nvme_refused_by_its_config_key(launches) -> None:
    launch = launches[2]
    assert launch.returncode == 0, launch.output[-20000:]
    configs = [tuple(r["zero"]) for r in launch.reports("OFFLOAD")]
    assert configs == [
        ("offload_param",),
        ("offload_optimizer", "offload_param", "stage3_param_persistence_threshold"),
    ], launch.output[-5000:]
