"""The public names: what ``shardavg`` exports is what users call, and the API reference shows each."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import shardavg
from shardavg import EMA, Options, WeightAverager
from shardavg.update import options

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "index.md"


def test_options_is_public_where_the_averager_is() -> None:
    """``WeightAverager(**options)`` takes an ``Options``' fields: the class is importable beside it."""
    assert "Options" in shardavg.__all__ and Options is options.Options
    given = Options(every_n_steps=2, dtype=None, device=torch.device("cpu"))
    averager = WeightAverager(nn.Linear(3, 2), EMA(decay=0.9), every_n_steps=2, dtype=None, device="cpu")
    assert averager.options == given


def test_every_public_name_is_in_the_api_reference() -> None:
    page = REFERENCE.read_text()
    missing = [name for name in shardavg.__all__ if f"::: shardavg.{name}\n" not in page]
    assert not missing, f"docs/reference/index.md lacks '::: shardavg.NAME' for {missing}"
    assert all(hasattr(shardavg, name) for name in shardavg.__all__)


def test_the_peers_averaging_functions_and_schedules_are_public() -> None:
    """Issue 60: torch's per-tensor ``avg_fn`` (``AvgFnRule``, what ``avg_fn=`` builds) and torchtitan's
    schedule (``HalfLifeFractionEMA``) are names users import, beside the other rules."""
    from shardavg import rules

    assert shardavg.AvgFnRule is rules.AvgFnRule and shardavg.HalfLifeFractionEMA is rules.HalfLifeFractionEMA
    assert {"AvgFnRule", "HalfLifeFractionEMA"} <= set(shardavg.__all__)
