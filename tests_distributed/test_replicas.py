"""Modules the replicated strategy would take but whose parameters are not replicas (hand-written
tensor parallelism, Megatron's tensor-parallel slices) are refused, naming the tensors and the
ranks, never exported as if whole; real replicas (DDP built after the averager on an unseeded
module) export exactly. One launch per world size (``scenario_replicas.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out


@pytest.mark.parametrize("world_size", [2, 4])
def test_non_replicas_are_refused_and_replicas_export_exactly(world_size: int, tmp_path: Path) -> None:
    launch = torchrun("scenario_replicas.py", world_size, str(tmp_path), timeout=300)
    assert launch.returncode == 0, launch.output[-20000:]
    refused = {(r["case"], r["world_size"]) for r in launch.reports("REFUSED")}
    assert refused == {(case, world_size) for case in ("shapes", "values", "megatron")}, launch.output[-5000:]
    (accepted,) = launch.reports("ACCEPTED")
    assert accepted == {"case": "ddp-unseeded", "world_size": world_size}
