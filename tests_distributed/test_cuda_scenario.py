"""tests_gpu/scenario_cuda.py run over gloo on the CPU: the GPU suite's checks stay honest on
machines without a GPU (where tests_gpu/ itself is skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

SCENARIO = str(Path(__file__).resolve().parents[1] / "tests_gpu" / "scenario_cuda.py")


def test_the_gpu_scenario_passes_on_the_cpu(tmp_path: Path) -> None:
    launch = torchrun(SCENARIO, 2, "cpu", "ddp,fsdp2", str(tmp_path), timeout=600)
    assert launch.returncode == 0, launch.output[-20000:]
    done = launch.reports("DONE")
    assert [d["engine"] for d in done] == ["ddp-float32", "ddp-bfloat16", "fsdp2-float32", "fsdp2-bfloat16"], done
