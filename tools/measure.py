"""Measuring a distributed step: time on the slowest rank, bytes communicated, peak allocated bytes."""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Timing:
    median_ms: float
    p90_ms: float
    rounds_ms: list[float]  # each kept round's time, in order: the runs of one round are a pair


def interleaved_ms(
    runs: list[Callable[[], object]],
    warmup: int,
    repeats: int,
    before: Callable[[], None],
    synchronize: Callable[[], None] = lambda: None,
) -> list[Timing]:
    """Milliseconds per call of each of ``runs`` on the slowest rank. After each ``before()``
    (untimed) every run is called once, each timed alone with the ranks aligned by a barrier: all
    runs see the same inputs, and a drift in the machine's speed falls on all of them alike. The
    order is shuffled each round, the same on every rank (seeded by the round; the runs may
    communicate): a run leaves the caches to the next (the live weights read, its own buffers
    written), and an order that only turns keeps each run behind the same one every round, a bias
    that no number of rounds averages away (two identical averagers measured 0.85-1.17 of each
    other that way). The first ``warmup`` rounds are not kept. ``synchronize`` waits for the
    device (``torch.cuda.synchronize``) before the clock starts and before it stops."""
    kept: list[list[float]] = [[] for _ in runs]
    for index in range(warmup + repeats):
        before()
        order = list(range(len(runs)))
        random.Random(index).shuffle(order)
        for run, times in ((runs[i], kept[i]) for i in order):
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            run()
            synchronize()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if index >= warmup:
                times.append(elapsed.item() * 1e3)
    return [_timing(times) for times in kept]


def _timing(rounds: list[float]) -> Timing:
    times = sorted(rounds)
    return Timing(statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))], rounds)


# c10d functions and the argument that holds what this rank receives
_RECEIVED = {
    "all_gather_into_tensor": 0,
    "all_gather": 0,
    "all_reduce": 0,
    "broadcast": 0,
    "reduce_scatter_tensor": 0,
    "all_to_all_single": 0,
    "recv": 0,
    "irecv": 0,
    "all_gather_object": None,
    "broadcast_object_list": None,
}


class CommCounter:
    """Bytes this rank receives through collectives and point-to-point ops inside ``with``.

    Counts both the ``torch.distributed`` functions (FSDP1, FSDP2's own gathers, DeepSpeed) and
    the functional collectives DTensor uses (``full_tensor()``), by what lands in this rank's
    output tensors."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[CommCounter]:
        originals = {name: getattr(dist, name) for name in _RECEIVED}

        def counted(name: str, function: Callable) -> Callable:
            def wrapper(*args, **kwargs):
                self.calls += 1
                index = _RECEIVED[name]
                if index is not None:
                    received = args[index] if len(args) > index else next(iter(kwargs.values()))  # the output
                    self.bytes += sum(t.nbytes for t in tree_leaves(received) if isinstance(t, torch.Tensor))
                return function(*args, **kwargs)

            return wrapper

        # DeepSpeed's backend holds its own references to torch's gather/scatter functions
        backend = _deepspeed_backend()
        cached = {name: getattr(backend, name) for name in ("all_gather_function", "reduce_scatter_function")
                  if getattr(backend, name, None) is not None}  # fmt: skip
        for name, function in originals.items():
            setattr(dist, name, counted(name, function))
        for name, function in cached.items():
            setattr(backend, name, counted("all_gather_into_tensor", function))
        try:
            with _FunctionalCollectives(self):
                yield self
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)
            for name, function in cached.items():
                setattr(backend, name, function)


def _deepspeed_backend() -> object | None:
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(deepspeed_comm, "cdb", None)


class _FunctionalCollectives(TorchDispatchMode):
    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and "wait" not in func.__name__:
            self.counter.calls += 1
            self.counter.bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def allocated_peak(run: Callable[[], object]) -> int:
    """Peak bytes held by torch's CPU allocator above the starting point while ``run()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        run()
    held = peak = 0
    events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: torch.device | None = None) -> float:
    """Bytes per second one rank moves in a large copy on ``device`` while every rank copies at
    once (read + write)."""
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    synchronize = torch.cuda.synchronize if source.is_cuda else lambda: None
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        target.copy_(source)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best
