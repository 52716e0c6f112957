"""Helpers shared by the single-process checkpoint tests."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import torch
from harness import TiedNet

from shardavg import EMA, WeightAverager


def trained(trainer, steps: int = 5, **kwargs) -> WeightAverager:
    """An averager that followed ``steps`` real optimizer steps of the trainer's model."""
    averager = WeightAverager(trainer.model, kwargs.pop("rule", EMA(decay=0.9)), **kwargs)
    for _ in range(steps):
        trainer.step()
        averager.update()
    return averager


def fresh(rule=None, **kwargs) -> WeightAverager:
    """An averager on an untrained model: whatever it holds after a load came from the checkpoint."""
    torch.manual_seed(0)
    return WeightAverager(TiedNet(), rule or EMA(decay=0.9), **kwargs)


def assert_same_average(a: WeightAverager, b: WeightAverager) -> None:
    got, want = a.full_state_dict(), b.full_state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a read from a FIFO blocks forever)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
