"""A process that saves an averager into one place as fast as it can, and the reference a reader
checks each load against: the shared half of the tests of readers running during a save.

    python tests_distributed/concurrent_saves.py TARGET STOP single|keep_last [PAUSE]

Every tensor of the model (``harness.TiedNet``) is filled with ``k`` before update ``k``, and every
update is saved (``keep_last`` 1 prunes the previous one). It prints ``saved`` after the first
save and stops once the file STOP exists.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from harness import TiedNet

from shardavg import SWA, WeightAverager

OPTIONS = {"buffers": "average", "include_frozen": True}  # every tensor stored: a load restores all
LIFETIME = 180  # seconds


def advance(model: torch.nn.Module, averager: WeightAverager) -> None:
    """Update ``k = num_updates + 1``: every tensor of the model filled with ``k`` first."""
    k = averager.num_updates + 1
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(k)
    averager.update(step=k)


class Reference:
    """The average after ``n`` of the writer's updates, computed by an averager of its own."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TiedNet()
        self.averager = WeightAverager(self.model, SWA(), **OPTIONS)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        while self.averager.num_updates < n:
            advance(self.model, self.averager)
            self.states[self.averager.num_updates] = self.averager.full_state_dict()
        return self.states[n]


def main() -> None:
    target, stop, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    torch.manual_seed(0)
    model = TiedNet()
    averager = WeightAverager(model, SWA(), **OPTIONS)
    parent, deadline = os.getppid(), time.monotonic() + LIFETIME
    while not stop.exists() and os.getppid() == parent and time.monotonic() < deadline:
        advance(model, averager)
        averager.save(target, keep_last={"single": None, "keep_last": 1}[kind])
        if averager.num_updates == 1:
            print("saved", flush=True)
        time.sleep(pause)


if __name__ == "__main__":
    main()
