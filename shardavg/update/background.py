"""The update off the training loop (``WeightAverager(..., background=True)``).

``update()`` decides at once whether the step is due, takes what the training step may change
before the update reads it (the buffers: a forward writes BatchNorm statistics, DDP broadcasts
them), and hands the rest to a thread of its own, one update in flight at a time; torch's
kernels release the GIL, so the averaging runs while the loop goes on. The live weights are
read by that thread, so the next write to them must wait for it:

- every torch optimizer's ``step()`` (which is how every engine writes its weights: FSDP1/FSDP2/
  DDP/TP/PP with a torch optimizer, DeepSpeed through the torch optimizer inside its own) waits
  first, through a global step pre-hook;
- the forward of a module that writes its own parameters (an embedding with ``max_norm``
  renormalises the rows it looks up) waits first, through a pre-hook on that module alone, so
  that the forwards of every other module still run beside the update;
- whatever writes the live weights from shardavg (``swapped()`` on entry and on exit,
  ``copy_into_model``) waits for every update in flight in the process, not only its own
  averager's (``wait_for_every_update``);
- every reader of the averages waits for its own (``WeightAverager`` does it before each method).

Any other writer (``model.load_state_dict``, a hand-written update, an optimizer that is not a
``torch.optim.Optimizer``) must call ``avg.wait()`` first; what the updater can see of one that
did not (a tensor's version counter moved while the thread read it) it reports through
``start``'s ``verify``. An error the thread met (a non-finite value under ``"raise"``, out of
memory, such a write) is raised at the next call, naming the step it came from; a warning it
meant to give (an update skipped under ``"skip"``) is kept (``base.deferred``) and given at that call, in
the caller's thread: issued on its own thread it would land whenever the thread got there, past
the ``warnings.catch_warnings`` block the loop had open, attributed to no line of the loop.

An interrupt (Ctrl-C, or any exception a signal handler raises) that lands while a caller waits
leaves the update recorded as in flight: the interrupt propagates at once, and the next call of
any kind (a save in an ``except KeyboardInterrupt`` block, the next ``update()``) joins the same
thread first, so the average is never read half-updated and two updates never run at once.

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
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..base.deferred import deferring

_EVERY: weakref.WeakSet[Background] = weakref.WeakSet()  # every background of the process, for the writers


def wait_for_every_update() -> None:
    """Collect every update in flight in the process, whatever averager started it: what a writer
    of live weights calls first (another averager of the same model may still read them).

    Their errors stay with their own averagers, raised at those averagers' next calls.
    """
    for background in list(_EVERY):
        background.wait(raise_failure=False)


def writes_weights_in_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward writes its own parameters in place: torch's embeddings with
    ``max_norm`` renormalise the rows they look up (the only such modules of ``torch.nn``)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None


class Background:
    """One update at a time on a thread of its own: ``start`` it, ``wait`` for it.

    Until an update is collected, every torch optimizer waits for it before it steps (a global
    optimizer pre-hook), and so does every module ``guard`` was given that writes its parameters
    in its forward (a forward pre-hook); both hooks go when this object is collected.

    Attributes:
        waited_seconds: How long callers were blocked collecting updates (what the loop paid).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None  # the update in flight, kept until it has landed
        self._landed = threading.Event()  # set by its thread when the update is over
        self._step = 0  # its step
        self._verify: Callable[[], None] | None = None  # its check at collection (CUDA), see ``start``
        self._failure: tuple[int, BaseException] | None = None
        self._warnings: list[Warning] = []  # what the thread meant to warn, given at the next call (``deferring``)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._done: dict[torch.device, torch.cuda.Event] = {}
        self._forward_hooks: list = []
        self.waited_seconds = 0.0
        this = weakref.ref(self)

        @torch.compiler.disable  # (under torch.compile: a call the graph breaks around, never traced)
        def collected(*_: object) -> None:
            background = this()
            if background is not None:
                background.wait()

        self._collected = collected
        optimizer_hook = register_optimizer_step_pre_hook(collected)
        weakref.finalize(self, _remove, [optimizer_hook], self._forward_hooks)
        _EVERY.add(self)

    def guard(self, modules: Iterable[nn.Module]) -> None:
        """Make the forward of every module among ``modules`` that writes its own parameters
        collect the update in flight first (replacing the hooks an earlier call placed).

        Args:
            modules: The averaged model's modules, after every rescan of its structure.
        """
        _remove(self._forward_hooks)
        self._forward_hooks.extend(
            module.register_forward_pre_hook(self._collected, prepend=True)
            for module in modules
            if writes_weights_in_forward(module)
        )

    def start(
        self,
        step: int,
        work: Callable[[], object],
        devices: Iterable[torch.device],
        verify: Callable[[], None] | None = None,
    ) -> None:
        """Run ``work()`` (the update of ``step``) on a new thread, once the previous one is collected.

        On each CUDA device in ``devices`` the work runs on a side stream that first waits for what
        the current stream has issued.

        Args:
            step: The step of the update, named by the error it may raise.
            work: The update.
            devices: The devices it touches.
            verify: Raises if the update's reads cannot be trusted (something wrote what it read);
                called when the reads are over: on the thread after ``work`` where everything is on
                the CPU, at collection (after the loop's streams wait for the side streams) on CUDA.

        Raises:
            Exception: What the previous update raised (see ``wait``).
        """
        self.wait()
        ready = {d: torch.cuda.current_stream(d).record_event() for d in set(devices) if d.type == "cuda"}
        self._step, self._verify = step, verify if ready else None
        landed = threading.Event()
        thread = threading.Thread(
            target=self._serve,
            args=(step, work, ready, None if ready else verify, landed),
            name=f"shardavg-update-{step}",
        )
        self._thread, self._landed = thread, landed  # (before it starts: an interrupt in start() leaves it recorded)
        thread.start()

    def _serve(
        self,
        step: int,
        work: Callable[[], object],
        ready: dict[torch.device, torch.cuda.Event],
        verify: Callable[[], None] | None,
        landed: threading.Event,
    ) -> None:
        try:
            streams = [self._side_stream(device) for device in ready]
            for stream, event in zip(streams, ready.values()):
                stream.wait_event(event)
            with contextlib.ExitStack() as on_side_streams, deferring(self._warnings):
                for stream in streams:
                    on_side_streams.enter_context(torch.cuda.stream(stream))
                work()
            self._done = {device: stream.record_event() for device, stream in zip(ready, streams)}
            if verify is not None:
                verify()
        except BaseException as error:  # (raised in the loop's thread at the next call)
            self._failure = (step, error)
        finally:
            landed.set()

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def wait(self, raise_failure: bool = True) -> None:
        """Collect the update in flight, if any: join its thread and order the loop's CUDA streams after its work.

        An interrupt while waiting propagates at once and leaves the update in flight, to be
        waited for by the next call; the update is forgotten only once it has landed. (The wait is
        on an event the thread sets, not on ``Thread.join()``: on Python 3.11 a join cut short by
        an exception marks the thread as ended while it still runs, bpo-45274.)

        Args:
            raise_failure: Issue what the update meant to warn (``base.deferred``) and raise what it
                raised; False keeps both for the next call that does.

        Warns:
            Warning: What the update meant to warn, each once, in the caller's thread.

        Raises:
            Exception: What the update raised (once), with a note naming its step.
        """
        thread = self._thread
        if thread is not None:
            began = time.perf_counter()
            if thread.ident is not None:  # (None: an interrupt in start() came before the launch: nothing applied)
                self._landed.wait()  # (an interrupt here leaves the update in flight)
                thread.join()  # (over: this only sees its thread exit)
                self._collect()
            self._thread, self._verify = None, None
            self.waited_seconds += time.perf_counter() - began
        if not raise_failure:
            return
        deferred, self._warnings = self._warnings, []
        for warning in deferred:  # (stacklevel 5: the loop's update(), through both Updaters' and the averager's)
            warnings.warn(warning, stacklevel=5)
        if self._failure is not None:
            (step, error), self._failure = self._failure, None
            error.add_note(f"(raised by the background update of step {step}, collected at this call)")
            raise error

    def _collect(self) -> None:
        """Once the update landed: the loop's streams wait for the side streams, then the reads are
        checked (CUDA). Safe to run again if an interrupt cut it short."""
        for device, event in self._done.items():
            torch.cuda.current_stream(device).wait_event(event)
        self._done = {}
        if self._verify is not None:
            try:
                self._verify()
            except Exception as error:
                self._failure = self._failure or (self._step, error)
            self._verify = None


def _remove(*handle_lists: list) -> None:
    """Remove the hooks in each list, emptying it."""
    for handles in handle_lists:
        while handles:
            handles.pop().remove()
