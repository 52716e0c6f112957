"""The main job's progress: tqdm's bar where stderr is a terminal, plain lines where it is a log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("tqdm", reason="tqdm (the main job's bar) is not installed (pip install -e '.[launch]')")
from tqdm import tqdm  # noqa: E402

from launch.progress import Progress  # noqa: E402


def drawn_on(controller: int) -> str:
    """Everything written to the terminal whose other side is ``controller``, once that side closed."""
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the terminal's side is closed and all of it was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    return b"".join(chunks).decode()


def drive(progress: Progress, start: int, total: int) -> None:
    for step in range(start + 1, total + 1):
        progress.step(step, loss=1.0 / step, tokens_per_s=1000.0 * step)
    progress.close()


def test_a_log_gets_a_plain_line_every_tenth_of_the_run_and_no_carriage_return() -> None:
    read, write = os.pipe()
    with os.fdopen(write, "w") as stream:
        progress = Progress(total=46, start=20, desc="fsdp2", stream=stream)
        assert progress.bar is None
        drive(progress, 20, 46)
    with os.fdopen(read) as pipe:
        output = pipe.read()
    assert "\r" not in output
    assert output.splitlines() == [  # every ceil(26 / 10) = 3 steps, and the last one
        f"fsdp2: step {s}/46, loss {1 / s:.3f}, {1000 * s} tokens/s" for s in (21, 24, 27, 30, 33, 36, 39, 42, 45, 46)
    ]


def test_a_short_run_gets_a_line_every_step_and_other_ranks_none(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as stream:
        drive(Progress(total=3, start=0, desc="ddp", stream=stream), 0, 3)
        drive(Progress(total=3, start=0, desc="ddp", stream=stream, enabled=False), 0, 3)
    assert (tmp_path / "log").read_text().splitlines() == [
        "ddp: step 1/3, loss 1.000, 1000 tokens/s",
        "ddp: step 2/3, loss 0.500, 2000 tokens/s",
        "ddp: step 3/3, loss 0.333, 3000 tokens/s",
    ]


def test_a_terminal_gets_the_bar() -> None:
    controller, terminal = os.openpty()
    with os.fdopen(terminal, "w") as stream:
        progress = Progress(total=5, start=2, desc="zero3", stream=stream)
        assert isinstance(progress.bar, tqdm) and progress.bar.n == 2
        drive(progress, 2, 5)
        assert progress.bar.n == 5
    drawn = drawn_on(controller)
    assert "\r" in drawn and "zero3: 100%" in drawn and "loss=0.200" in drawn, drawn


def test_other_ranks_show_no_bar_on_a_terminal() -> None:
    controller, terminal = os.openpty()
    with os.fdopen(terminal, "w") as stream:
        progress = Progress(total=5, start=0, desc="fsdp2", stream=stream, enabled=False)
        drive(progress, 0, 5)
    assert progress.bar is None
    assert drawn_on(controller) == ""
