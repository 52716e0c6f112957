"""The documentation's integration snippets and the README's usage block run as written, under torchrun on 2
CPU processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import ZERO, torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out

ENVIRONMENTS = {
    "accelerate": {"ACCELERATE_USE_CPU": "true"},
    "deepspeed": {},
    "lightning": {},
    "readme": {},
    "transformers": {},
}


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_the_documented_snippet_runs(name: str, tmp_path: Path) -> None:
    zero = ZERO if name == "deepspeed" else ()
    launch = torchrun("scenario_snippets.py", 2, name, str(tmp_path), timeout=300, env=ENVIRONMENTS[name], preload=zero)
    assert launch.returncode == 0, launch.output[-20000:]
    assert {"name": name, "world_size": 2} in launch.reports("SNIPPET"), launch.output[-5000:]
