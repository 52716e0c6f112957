"""``python -m tools.device_check``, the one command a GPU session runs first, kept working where no
GPU is: its dry mode as a user runs it (every stage named, skipped with the reason, its command
checked against the tools and tests it calls, the device named, in seconds), the way it runs
stages (one that hangs stopped at its budget with the processes it started, one that fails
recorded, the rest still run, the record rewritten after each), how it reads a stopped pytest,
and the training loop's verdict variant it asks ``tools.loop`` for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("yaml", reason="PyYAML (the bench's configs) is not installed (pip install -e '.[launch]')")
from tools import device_check, loop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_names_every_stage_skipped_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "record" / "device_check.json"
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tools.device_check", "--dry", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    assert took < 30, f"the dry run took {took:.1f} s"
    record = json.loads(out.read_text())
    assert (record["mode"], record["reason"]) == ("dry", "--dry given")
    assert record["device"]["torch"] == torch.__version__ and record["device"]["shardavg"]
    assert record["device"]["name"] or record["device"]["why_none"]
    assert [stage["name"] for stage in record["stages"]] == [stage.name for stage in device_check.STAGES]
    for stage in record["stages"]:
        assert (stage["status"], stage["reason"], stage["preflight"]) == ("skipped", "--dry given", "ok"), stage
        assert stage["command"].startswith(f"{sys.executable} -m ") and stage["shows"], stage
    assert sum(stage["budget_s"] for stage in record["stages"]) <= record["budget_s"] <= 8 * 60
    assert "device: " in done.stdout and all(f"| {s.name} | skipped |" in done.stdout for s in device_check.STAGES)
    assert list(tmp_path.glob("record/.*")) == [], "a temporary file was left beside the record"


def python_stage(name: str, code: str, budget_s: int, problem: str | None = None) -> device_check.Stage:
    """A stage that runs ``code`` in Python and passes where it printed ``fine``."""
    return device_check.Stage(
        name, f"runs {name}", budget_s, lambda scratch: [sys.executable, "-c", code],
        lambda scratch, output: device_check.Outcome("fine" in output, output.strip()[-40:], {"said": output}),
        lambda: problem,
    )  # fmt: skip


def test_a_stage_that_hangs_is_stopped_with_its_processes_and_the_rest_still_run(tmp_path: Path) -> None:
    """The hung stage started two processes (as pytest starts torchrun), one in a session of its own
    (as torchrun starts each rank): all three are stopped at its budget, and the stages after it run."""
    pids = tmp_path / "pids"
    hangs = (
        "import os, subprocess, sys, time\n"
        "sleep = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
        "child, rank = subprocess.Popen(sleep), subprocess.Popen(sleep, start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}} {{rank.pid}}')\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    stages = (
        python_stage("hangs", hangs, budget_s=3),
        python_stage("fails", "print('boom'); raise SystemExit(3)", budget_s=30),
        python_stage("refused", "print('fine')", budget_s=30, problem="a renamed key"),
        python_stage("left-out", "print('fine')", budget_s=30),
        python_stage("passes", "print('fine')", budget_s=30),
    )
    written: list[list[str]] = []
    chosen = {"hangs", "fails", "refused", "passes"}
    began = time.monotonic()
    records = device_check.run(stages, chosen, tmp_path, began + 60,
                               lambda so_far: written.append([r["status"] for r in so_far]))  # fmt: skip
    assert time.monotonic() - began < 3 + device_check.GRACE_S + 10
    by_name = {record["name"]: record for record in records}
    assert [record["status"] for record in records] == ["timed out", "failed", "error", "skipped", "passed"]
    assert by_name["hangs"]["result"].startswith("stopped at 3 s") and "started" in by_name["hangs"]["output_tail"]
    left = [int(pid) for pid in pids.read_text().split() if device_check.running(int(pid))]
    for pid in left:  # (not to outlive a failing test)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the stopped stage ran on: {left}"
    assert by_name["fails"]["result"] == "exit 3; boom" and by_name["fails"]["returncode"] == 3
    assert by_name["refused"]["reason"] == "a renamed key" and "seconds" not in by_name["refused"]
    assert by_name["left-out"]["reason"] == "not in --only"
    assert by_name["passes"]["figures"] == {"said": "fine\n"} and by_name["passes"]["seconds"] < 30
    assert written == [[record["status"] for record in records][:n] for n in range(1, 6)], "not written after each"


def test_no_stage_starts_once_the_runs_time_is_spent(tmp_path: Path) -> None:
    (record,) = device_check.run((python_stage("late", "print('fine')", 30),), {"late"}, tmp_path,
                                 time.monotonic() + 5, lambda so_far: None)  # fmt: skip
    spent = f"the run's {device_check.TOTAL_S} s were spent before it"
    assert (record["status"], record["reason"]) == ("skipped", spent)


VERBOSE = """\
collecting ... collected 4 items

tests_gpu/test_a.py::test_one[fp32] PASSED                                [ 25%]
tests_gpu/test_a.py::test_one[bf16] FAILED                                [ 50%]
tests_gpu/test_b.py::test_two SKIPPED (2 ranks need 2 GPUs)               [ 75%]
tests_gpu/test_b.py::test_three """


def test_a_stopped_pytest_is_read_from_its_verbose_lines() -> None:
    read = device_check.read_pytest(VERBOSE)
    assert not read.ok
    assert read.figures == {"outcomes": {"passed": 1, "failed": 1, "skipped": 1},
                            "failed": ["tests_gpu/test_a.py::test_one[bf16]"],
                            "running_when_stopped": "tests_gpu/test_b.py::test_three"}  # fmt: skip
    finished = VERBOSE.replace("[bf16] FAILED", "[bf16] PASSED").replace("test_three ", "test_three PASSED [100%]")
    assert device_check.read_pytest(finished + "\n==== 3 passed, 1 skipped in 2.0s ====\n").ok


def test_the_loop_times_the_loops_verdict_when_asked() -> None:
    config = loop.LoopConfig(layers=1, dim=8, dtype="float32", batch=4, steps=1, warmup=1, rounds=1)
    rows = loop.measure(config, torch.device("cpu"), verdict=True)
    assert [row.variant for row in rows] == [*loop.VARIANTS, loop.VERDICT]
    on_gpu = loop.LoopRow(loop.VERDICT, 10.0, 5.5, 1, "bfloat16", "cuda")
    assert loop.verdict(on_gpu) == "<= +5% MISS"
