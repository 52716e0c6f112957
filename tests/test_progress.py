"""Progress of long offline commands: drawn in place on a terminal (a pseudo-terminal here, its
output read back raw), at most ten redraws a second, and nothing on a pipe or with ``--quiet``."""

from __future__ import annotations

import io
import os
import pty
import tty
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardavg
import shardavg.cli
from shardavg.base.progress import Progress, duration, size


class Terminal:
    """A pseudo-terminal: ``stream`` writes to it as to a terminal, ``read()`` what reached it."""

    def __init__(self) -> None:
        self.master, slave = pty.openpty()
        tty.setraw(slave)  # (bytes as written: no "\r\n" for "\n")
        os.set_blocking(self.master, False)
        self.stream = open(slave, "w", buffering=1)  # noqa: SIM115 (closed by close())

    def read(self) -> str:
        data = b""
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except BlockingIOError:
                return data.decode()
            data += chunk

    def close(self) -> None:
        self.stream.close()
        os.close(self.master)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    opened = Terminal()
    yield opened
    opened.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_sees_bytes_rate_and_time_left_redrawn_in_place(terminal: Terminal) -> None:
    clock = Clock()
    progress = Progress("merge", terminal.stream, clock=clock)
    progress.start(3 * 2**30)
    clock.now += 2.0
    progress.advance(2**30)
    clock.now += 0.05  # (within a tenth of a second of the last drawing: not drawn)
    progress.advance(2**29)
    clock.now += 0.95
    progress.advance(2**29)
    progress.close()
    assert terminal.read() == (
        "\rmerge: 0 B of 3 GiB (0%)"
        "\rmerge: 1 GiB of 3 GiB (33%), 512 MiB/s, 0:04 left"
        "\rmerge: 2 GiB of 3 GiB (66%), 683 MiB/s, 0:02 left"
        "\rmerge: 2 GiB of 3 GiB (66%), 683 MiB/s, 0:02 left\n"
    )


def test_at_most_ten_redraws_a_second_and_the_end_always(terminal: Terminal) -> None:
    clock = Clock()
    progress = Progress("export", terminal.stream, clock=clock)
    progress.start(10_000)
    for _ in range(10_000):  # 10,000 writes of a byte over 2 seconds
        clock.now += 0.0002
        progress.advance(1)
    progress.close()
    lines = terminal.read().split("\r")[1:]
    assert 20 <= len(lines) <= 1 + 20 + 1 + 1, len(lines)  # start, 10 a second, the last write, close
    assert lines[-1] == "export: 9.77 KiB of 9.77 KiB (100%), 4.88 KiB/s, 0:00 left\n"
    assert lines[-2] == lines[-1].removesuffix("\n")  # (the last write is drawn when it ends the work)


def test_a_shorter_line_blanks_what_the_longer_one_left(terminal: Terminal) -> None:
    clock = Clock()
    progress = Progress("merge", terminal.stream, clock=clock)
    progress.start(2000)
    clock.now += 1
    progress.advance(1000)
    progress.total = 0  # (a line without a percentage: shorter)
    clock.now += 1
    progress.advance(0)
    drawn = terminal.read().split("\r")
    assert drawn[-1] == "merge: 1000 B of 0 B, 500 B/s, 0:00 left".ljust(len(drawn[-2])), drawn


def test_a_pipe_a_file_or_quiet_shows_nothing(terminal: Terminal) -> None:
    read, write = os.pipe()
    written = io.StringIO()
    with open(write, "w") as pipe:
        for stream, quiet in ((pipe, False), (written, False), (terminal.stream, True)):
            with Progress("merge", stream, quiet=quiet) as progress:
                progress.start(100)
                progress.advance(100)
    with open(read) as pipe:
        assert pipe.read() == ""
    assert written.getvalue() == "" and terminal.read() == ""


def test_counted_tensors_are_counted_once_written_and_let_go() -> None:
    progress = Progress("x", io.StringIO())
    seen = []
    for tensor in progress.counted((torch.ones(n) for n in (4, 8)), 48):
        seen.append(progress.done)
        del tensor
    assert seen == [0, 16] and progress.done == 48


def test_sizes_and_durations_read_as_people_write_them() -> None:
    assert [size(n) for n in (0, 1023, 1024, 1536, 5 * 2**30, 1.5 * 2**50)] == [
        "0 B", "1023 B", "1 KiB", "1.5 KiB", "5 GiB", "1.5 PiB"
    ]  # fmt: skip
    assert [duration(s) for s in (0, 59.6, 61, 3600, 90061)] == ["0:00", "1:00", "1:01", "1:00:00", "25:01:01"]


# --------------------------------------------------------------------------- the commands


def model(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({f"layer{i}.weight": torch.randn(64, 64, generator=generator) for i in range(4)},
              str(folder / "model.safetensors"))  # fmt: skip
    return folder


def run(terminal_or_none: Terminal | None, monkeypatch: pytest.MonkeyPatch, capsys, *args: str) -> str:
    """``shardavg ARGS`` in this process, its stderr a terminal (or captured, a pipe's stand-in); what stderr got."""
    if terminal_or_none is not None:
        monkeypatch.setattr("sys.stderr", terminal_or_none.stream)
    assert shardavg.cli.main(list(args)) == 0
    return terminal_or_none.read() if terminal_or_none is not None else capsys.readouterr().err


def test_merge_and_export_show_progress_on_a_terminal_only(tmp_path: Path, terminal: Terminal, monkeypatch,
                                                           capsys) -> None:  # fmt: skip
    inputs = [str(model(tmp_path / f"in{i}", i)) for i in range(2)]
    shown = run(terminal, monkeypatch, capsys, "merge", *inputs, "--out", str(tmp_path / "a"))
    assert shown.startswith("\rmerge: 0 B of 64 KiB (0%)") and shown.endswith("\n"), shown
    assert "\rmerge: 64 KiB of 64 KiB (100%)" in shown, shown
    assert run(terminal, monkeypatch, capsys, "merge", *inputs, "--out", str(tmp_path / "b"), "--quiet") == ""
    monkeypatch.undo()
    assert "\r" not in run(None, monkeypatch, capsys, "merge", *inputs, "--out", str(tmp_path / "c"))

    avg = shardavg.WeightAverager(torch.nn.Linear(64, 64), shardavg.EMA(decay=0.5))
    avg.update()
    avg.save(tmp_path / "ckpt")
    shown = run(terminal, monkeypatch, capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "export"))
    assert shown.startswith("\rexport: 0 B of 16.2 KiB (0%)") and "\rexport: 16.2 KiB of 16.2 KiB (100%)" in shown
    assert shown.endswith("\n")
    assert run(terminal, monkeypatch, capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "e2"), "--quiet") == ""
    monkeypatch.undo()
    assert "\r" not in run(None, monkeypatch, capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "e3"))

    foreign = tmp_path / "foreign"  # someone's weights: refused once the writer checks its target
    foreign.mkdir()
    save_file({"w": torch.ones(1)}, str(foreign / "model.safetensors"))
    monkeypatch.setattr("sys.stderr", terminal.stream)
    for args in (["export", str(tmp_path / "ckpt"), str(foreign)], ["merge", *inputs, "--out", str(foreign)]):
        assert shardavg.cli.main(args) == 2
        said = terminal.read()
        assert said.startswith("shardavg: error: ") and said.count("\n") == 1 and "\r" not in said, said


def test_posthoc_shows_progress_on_a_terminal(tmp_path: Path, terminal: Terminal, monkeypatch, capsys) -> None:
    model = torch.nn.Linear(64, 64)
    snapshots = shardavg.PostHocEMA(model, sigma_rels=(0.05, 0.10), snapshot_every=1, directory=tmp_path / "snaps")
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        snapshots.update()
    args = ["posthoc", str(tmp_path / "snaps"), "--sigma-rel", "0.08"]
    shown = run(terminal, monkeypatch, capsys, *args[:2], str(tmp_path / "out"), *args[2:])
    assert shown.startswith("\rposthoc: 0 B of 16.2 KiB (0%)") and "\rposthoc: 16.2 KiB of 16.2 KiB (100%)" in shown
    assert run(terminal, monkeypatch, capsys, *args[:2], str(tmp_path / "quiet"), *args[2:], "--quiet") == ""
