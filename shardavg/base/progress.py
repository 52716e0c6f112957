"""Progress of long offline work (``shardavg merge``, ``export``, ``posthoc``) on a terminal.

A merge of a 140 GB model takes minutes; without a word it looks hung. ``Progress`` shows the
bytes written of the total, the rate and the time left on one line of stderr, redrawn in place
(a carriage return) at most ten times a second, when stderr is a terminal. Where it is not (a
log file, a pipe) nothing is shown, so logs hold no carriage-return lines (the command's last
line says what it wrote), and ``--quiet`` turns it off on a terminal too. A few lines of
arithmetic rather than tqdm: the core depends on nothing it can do without.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

INTERVAL = 0.1  # seconds between redraws, at least (ten a second at most)
UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class Progress:
    """Bytes done of a total, drawn on ``stream`` (stderr) when it is a terminal and not ``quiet``.

    Call ``start(total)`` when the writing starts, ``advance(nbytes)`` as bytes are written (or
    wrap the tensors written in ``counted``, which does both), and ``close()`` at the end (it ends
    the line). Off a terminal every call does nothing but count. ``clock`` is for tests."""

    def __init__(
        self,
        what: str,
        stream: TextIO | None = None,
        *,
        quiet: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.stream, self.clock = what, sys.stderr if stream is None else stream, clock
        self.shown = not quiet and _terminal(self.stream)
        self.total = self.done = 0
        self.started = self.drawn = 0.0
        self.width = 0  # of the line last drawn, to blank what a shorter one leaves

    def start(self, total: int) -> None:
        """Count from zero towards ``total`` bytes, and show it."""
        self.total, self.done, self.started = total, 0, self.clock()
        if self.shown:
            self._draw(self.started)

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more written; redrawn if the last drawing is ``INTERVAL`` old, or at the end."""
        self.done += nbytes
        if self.shown:
            now = self.clock()
            if now - self.drawn >= INTERVAL or self.done >= self.total:
                self._draw(now)

    def counted(self, tensors: Iterable[Any], total: int) -> Iterator[Any]:
        """``tensors`` (``total`` bytes) as they come, started when the writer asks for the first
        (once it has checked its target: a refusal shows no progress), each one's bytes counted
        once it asks for the next (it has written this one then); none is held here past its turn."""
        self.start(total)
        for tensor in tensors:
            nbytes = tensor.nbytes
            yield tensor
            del tensor  # (before the next one is made)
            self.advance(nbytes)

    def close(self) -> None:
        """Draw the last state and end the line (nothing when nothing was shown)."""
        if self.shown and self.width:
            self._draw(self.clock())
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self, now: float) -> str:
        """What is drawn at ``now``: done of total, percent, rate and time left (once it is measurable)."""
        text = f"{self.what}: {size(self.done)} of {size(self.total)}"
        if self.total:
            text += f" ({100 * self.done // self.total}%)"
        elapsed = now - self.started
        if elapsed > 0 and self.done:
            rate = self.done / elapsed
            text += f", {size(rate)}/s, {duration(max(self.total - self.done, 0) / rate)} left"
        return text

    def _draw(self, now: float) -> None:
        text = self.line(now)
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width, self.drawn = len(text), now


def _terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # (no isatty, or a closed stream)
        return False


def size(nbytes: float) -> str:
    """``nbytes`` in binary units, three significant digits: ``512 B``, ``1.50 GiB``."""
    unit = 0
    while nbytes >= 1024 and unit < len(UNITS) - 1:
        nbytes /= 1024
        unit += 1
    return f"{int(nbytes)} B" if unit == 0 else f"{nbytes:.3g} {UNITS[unit]}"


def duration(seconds: float) -> str:
    """``seconds`` as ``M:SS`` or ``H:MM:SS``."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
