"""An interrupt (Ctrl-C, or any exception a signal handler raises) while the loop waits for a
background update: the average stays whole (the update lands, counted, before anything reads
or saves it) and no second update starts while the first still writes."""

from __future__ import annotations

import copy
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from shardavg import WeightAverager


def lerp(shadows, lives, num_updates) -> None:
    """An EMA of decay 0.9 as a ``multi_avg_fn``: the reference, in the loop."""
    torch._foreach_lerp_(shadows, lives, 0.1)


class Blocking:
    """``lerp`` that reads the live weights only once ``gate`` is open, counting how many run at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.running = 0
        self.most_at_once = 0
        self.lock = threading.Lock()

    def __call__(self, shadows, lives, num_updates) -> None:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            assert self.gate.wait(timeout=30), "the gate was never opened"
            lerp(shadows, lives, num_updates)
        finally:
            with self.lock:
                self.running -= 1


def waiting_for_an_update(frame) -> bool:
    """Whether the thread whose top frame is ``frame`` is blocked inside ``Background.wait``."""
    if frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("background.py"):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def interrupt_when_waiting() -> Iterator[threading.Thread]:
    """A thread that raises ``KeyboardInterrupt`` in the main thread (through a signal handler, as
    Ctrl-C does) as soon as it blocks joining a background update, and not before."""
    main = threading.main_thread()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    def send() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main.ident)
            if frame is not None and waiting_for_an_update(frame):
                signal.pthread_kill(main.ident, signal.SIGUSR1)
                return
            time.sleep(0.001)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=send, name="interrupter")
    try:
        yield sender
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("then", ["save", "update"])
def test_an_interrupt_while_the_loop_waits_leaves_the_average_whole(tmp_path: Path, interrupt_when_waiting, then):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    blocking = Blocking()
    blocking.gate.set()
    background, loop = WeightAverager(net, blocking, background=True), WeightAverager(net, lerp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def forward_backward(step: int) -> None:
        optimizer.zero_grad()
        net(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()

    for step in (1, 2):
        forward_backward(step)
        optimizer.step()
        background.update(step)
        loop.update(step)
    background.wait()
    blocking.gate.clear()
    background.update(3)  # in flight, its reads held back by the gate
    loop.update(3)
    forward_backward(4)
    interrupt_when_waiting.start()
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()  # Ctrl-C lands where the loop waits for the update: in the optimizer's pre-hook
    interrupt_when_waiting.join()
    threading.Timer(0.2, blocking.gate.set).start()  # the update may land only later
    if then == "update":  # the loop goes on (the optimizer never stepped): the next update waits for the first
        background.update(5)
        loop.update(5)
        assert blocking.most_at_once == 1, "a second update ran while the first still wrote the shadows"

    def saved(averager: WeightAverager, name: str) -> dict[str, torch.Tensor]:
        fresh = WeightAverager(copy.deepcopy(net), averager.rule)
        fresh.load(averager.save(tmp_path / name))  # what `except KeyboardInterrupt: avg.save(...)` writes
        assert fresh.num_updates == (4 if then == "update" else 3)
        return fresh.full_state_dict()

    got, want = saved(background, "background"), saved(loop, "loop")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert blocking.most_at_once == 1
