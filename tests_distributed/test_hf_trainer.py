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
