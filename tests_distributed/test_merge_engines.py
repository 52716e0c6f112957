"""``shardavg merge`` on real DeepSpeed ZeRO-1/2/3 saves, against DeepSpeed's own reader (CPU, gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import ZERO, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out


def test_raw_zero_tags_read_as_deepspeeds_own_reader_reads_them(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    launch = torchrun(
        "scenario_merge_deepspeed.py", 2, str(tmp_path), timeout=420, env={"DS_ACCELERATOR": "cpu"}, preload=ZERO
    )
    assert launch.returncode == 0, launch.output[-20000:]
    labels = {r["label"] for r in launch.reports("MERGED_ZERO")}
    assert labels == {"zero1", "zero2", "zero2-bf16", "zero3-persist0", "zero3"}, launch.output[-5000:]
