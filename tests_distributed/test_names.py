"""A Hugging Face model keeps its own names under every engine, wrapper and wrapping order."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out


def test_a_hugging_face_model_keeps_its_names_under_every_engine_and_wrapper(tmp_path: Path) -> None:
    launch = torchrun("scenario_names.py", 2, str(tmp_path), timeout=420)
    assert launch.returncode == 0, launch.output[-20000:]
    (planned,) = launch.reports("PLANNED")
    wrappings = planned["wrappings"]
    for engine in ("fsdp1", "fsdp2", "zero3", "ddp"):
        assert any(w.startswith(engine) for w in wrappings), f"no {engine} wrapping planned"
    for wrapper in ("checkpoint-before", "checkpoint-after", "compiled-blocks"):
        assert sum(wrapper in w for w in wrappings) >= 3, f"{wrapper} is not tried under three engines"
    assert [r["wrapping"] for r in launch.reports("NAMES")] == wrappings, launch.output[-5000:]
