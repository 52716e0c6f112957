"""The documentation cannot rot: the docstrings' examples run (doctest), and the site builds with
``mkdocs build --strict`` (a broken link, a missing page or an API reference to a name that does
not exist fails it)."""

from __future__ import annotations

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [
    "shardavg.averager.weight_averager",
    "shardavg.rules",
    "shardavg.strategies",
    "shardavg.posthoc",
    "shardavg.integrations.accelerate",
    "shardavg.integrations.transformers",
    "shardavg.integrations.lightning",
    # (its example builds an engine: DeepSpeed's first in an environment compiles its CPU op, ~1 minute)
    pytest.param("shardavg.integrations.deepspeed", marks=pytest.mark.slow),
]


# DeepSpeed announces itself (its accelerator pick, an op it compiled for this machine) on stdout,
# differently per machine and only the first time in a process: not the examples' output.
FRAMEWORK_NOTICE = re.compile(r"DeepSpeed \S+ built successfully|\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING)\]")


class WithoutFrameworkNotices(doctest.OutputChecker):
    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        kept = "".join(line for line in got.splitlines(keepends=True) if not FRAMEWORK_NOTICE.match(line))
        return super().check_output(want, kept, optionflags)


@pytest.mark.parametrize("module", EXAMPLES)
def test_the_docstring_examples_run(module: str) -> None:
    runner = doctest.DocTestRunner(checker=WithoutFrameworkNotices(), optionflags=doctest.ELLIPSIS, verbose=False)
    for test in doctest.DocTestFinder().find(importlib.import_module(module)):
        runner.run(test)
    failures, tried = runner.summarize(verbose=False)
    assert tried > 0, f"{module} has no example"
    assert failures == 0, f"{failures} of {tried} example lines of {module} failed (the output above says which)"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "reference" / "index.html").is_file()
