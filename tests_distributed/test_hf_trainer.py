"""The Hugging Face Trainer callback under DDP and DeepSpeed ZeRO-3 at 2 processes on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import ZERO, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCRIPT = "scenario_hf_trainer.py"


@pytest.mark.parametrize("kind", ["ddp", "deepspeed"])
def test_the_trainer_callback_averages_saves_resumes_evaluates_and_exports(kind: str, tmp_path: Path) -> None:
    for mode in ("first", "second"):
        launch = torchrun(
            SCRIPT, 2, mode, kind, str(tmp_path), timeout=420, preload=ZERO if kind == "deepspeed" else ()
        )
        assert launch.returncode == 0, launch.output[-20000:]
        assert [r["mode"] for r in launch.reports("TRAINER")] == [mode], launch.output[-5000:]


def test_both_ranks_of_one_node_saving_with_save_on_each_node_is_refused(tmp_path: Path) -> None:
    # ZeRO-3 on CPU with accelerate not set up: every rank is its node's process zero, and with
    # save_on_each_node=True both would rotate output_dir under save_total_limit=2. Before: trained.
    launch = torchrun(SCRIPT, 2, "each_node", "deepspeed", str(tmp_path), timeout=240, preload=ZERO)
    assert launch.returncode == 0, launch.output[-20000:]
    assert [r["savers"] for r in launch.reports("REFUSED")] == [[0, 1]], launch.output[-5000:]
