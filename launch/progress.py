"""The training loop's progress on stderr: a bar for a person at a terminal, plain lines for a log.

tqdm redraws its bar with carriage returns, which a terminal overwrites in place but a log file
(stderr redirected, or a pipe to a scheduler's log) keeps, one per refresh. So the bar is drawn
only where the stream is a terminal; anywhere else the loop prints one plain line every tenth of
the run (and at its last step).
"""

from __future__ import annotations

import contextlib
import math
from typing import TextIO

LINES = 10  # plain progress lines over a run, where the stream is not a terminal


class Progress:
    """Rank 0's progress through ``start + 1 .. total``: tqdm's bar on a terminal, else a line
    every ``every`` steps. ``enabled=False`` (the other ranks) shows nothing."""

    def __init__(self, total: int, start: int, desc: str, stream: TextIO, enabled: bool = True) -> None:
        self.total, self.desc, self.stream, self.enabled = total, desc, stream, enabled
        self.every = max(1, math.ceil((total - start) / LINES))
        self.bar = None
        if enabled and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, file=stream)

    def redirect_logging(self) -> contextlib.AbstractContextManager:
        """Log records drawn above the bar rather than through it (nothing to do without a bar)."""
        if self.bar is None:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm()

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Step ``step`` is done, with this training loss and throughput so far."""
        if self.bar is not None:
            self.bar.update()
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
        elif self.enabled and (step % self.every == 0 or step == self.total):
            line = f"{self.desc}: step {step}/{self.total}, loss {loss:.3f}, {tokens_per_s:.0f} tokens/s"
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
