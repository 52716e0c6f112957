"""Megatron-Core GPT models (tied embeddings, SwiGLU) averaged live under torchrun (``scenario_megatron.py``),
one launch per world size, every layout in it: at 2 ranks TP2, PP2 and PP2 with two virtual chunks; at 4 ranks TP2 x DP2
and TP2 x PP2; each checked bitwise against a reference assembled from Megatron's own description, its
outputs resharded into the next layout and read back at TP1/PP1."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

LAYOUTS = {2: ["tp2-pp1", "tp1-pp2", "tp1-pp2-vp2"], 4: ["tp2-pp1", "tp2-pp2"]}


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_megatron_layouts_average_exactly_and_reshard(world_size: int, tmp_path: Path) -> None:
    launch = torchrun("scenario_megatron.py", world_size, str(tmp_path), *LAYOUTS[world_size], timeout=300)
    assert launch.returncode == 0, launch.output[-20000:]
    dp = {layout: world_size // (int(layout[2]) * int(layout[6])) for layout in LAYOUTS[world_size]}
    labels = [f"{layout}-dp{dp[layout]}" for layout in LAYOUTS[world_size]]
    assert [r["layout"] for r in launch.reports("LAYOUT")] == labels, launch.output[-5000:]
    assert {r["tensors"] for r in launch.reports("LAYOUT")} == {52}  # the full model's tensors, on every layout
    assert [r["layout"] for r in launch.reports("TP1")] == labels, launch.output[-5000:]
