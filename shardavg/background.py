"""The update off the training loop (``WeightAverager(..., background=True)``).

``update()`` decides at once whether the step is due, takes what the training step may change
before the update reads it (the buffers: a forward writes BatchNorm statistics, DDP broadcasts
them), and hands the rest to a thread of its own, one update in flight at a time; torch's
kernels release the GIL, so the averaging runs while the loop goes on. The live weights are
read by that thread, so the next write to them must wait for it: a pre-hook on every torch
optimizer's ``step()`` (which is how every engine writes its weights: FSDP1/FSDP2/DDP/TP/PP with
a torch optimizer, DeepSpeed through the torch optimizer inside its own) waits before the
optimizer writes. Every reader of the averages waits too (``WeightAverager`` does it before
each method), and an error the thread met (a non-finite value under ``"raise"``, out of
memory) is raised there, at the next call, naming the step it came from.

On CUDA the thread issues its work on a side stream that first waits for what the loop had
issued before ``update()`` (the optimizer step), and the loop's stream waits for the side
stream when the update is collected, so the host never waits for the device on the loop's
behalf. The thread ends with its update: nothing is left running after an exception or at exit
(the interpreter joins a running update before it exits).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class Background:
    """One update at a time on a thread of its own: ``start`` it, ``wait`` for it.

    Until an update is collected, every torch optimizer waits for it before it steps (a global
    optimizer pre-hook, removed when this object is collected).

    Attributes:
        waited_seconds: How long callers were blocked collecting updates (what the loop paid).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._done: dict[torch.device, torch.cuda.Event] = {}
        self.waited_seconds = 0.0  # how long callers were blocked collecting updates (what the loop paid)
        this = weakref.ref(self)

        def before_optimizer_step(*_: object) -> None:
            background = this()
            if background is not None:
                background.wait()

        handle = register_optimizer_step_pre_hook(before_optimizer_step)
        weakref.finalize(self, handle.remove)

    def start(self, step: int, work: Callable[[], object], devices: Iterable[torch.device]) -> None:
        """Run ``work()`` (the update of ``step``) on a new thread, once the previous one is collected.

        On each CUDA device in ``devices`` the work runs on a side stream that first waits for what
        the current stream has issued.

        Args:
            step: The step of the update, named by the error it may raise.
            work: The update.
            devices: The devices it touches.

        Raises:
            Exception: What the previous update raised (see ``wait``).
        """
        self.wait()
        ready = {d: torch.cuda.current_stream(d).record_event() for d in set(devices) if d.type == "cuda"}
        thread = threading.Thread(target=self._run, args=(step, work, ready), name=f"shardavg-update-{step}")
        self._thread = thread
        thread.start()

    def _run(self, step: int, work: Callable[[], object], ready: dict[torch.device, torch.cuda.Event]) -> None:
        try:
            streams = [self._side_stream(device) for device in ready]
            for stream, event in zip(streams, ready.values()):
                stream.wait_event(event)
            with contextlib.ExitStack() as on_side_streams:
                for stream in streams:
                    on_side_streams.enter_context(torch.cuda.stream(stream))
                work()
            self._done = {device: stream.record_event() for device, stream in zip(ready, streams)}
        except BaseException as error:  # (raised in the loop's thread at the next call)
            self._failure = (step, error)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def wait(self) -> None:
        """Collect the update in flight, if any: join its thread and order the loop's CUDA streams after its work.

        Raises:
            Exception: What the update raised (once), with a note naming its step.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        began = time.perf_counter()
        thread.join()
        self.waited_seconds += time.perf_counter() - began
        done, self._done = self._done, {}
        for device, event in done.items():
            torch.cuda.current_stream(device).wait_event(event)
        failure, self._failure = self._failure, None
        if failure is not None:
            step, error = failure
            error.add_note(f"(raised by the background update of step {step}, collected at this call)")
            raise error
