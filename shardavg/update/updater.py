"""The update pipeline, in one place: what ``WeightAverager.update()`` does to the shadows.

An ``Updater`` keeps the state's live views grouped for the fused kernels (``fused.py``) and
regroups them only when the engine really changed them; it stages local shards for offloaded
shadows and casts (``staging.py``); it screens them for NaN and infinity, on the host, or on an
accelerator without a host read (the verdicts read later, ``settle``), or takes the loop's own
verdict instead (``Given``) where its check (``check.py``: the trust the verdicts have earned, and
when to screen) says it can be trusted; it looks up each rule's weight; and it is the one place
that counts an update, applied or skipped. No collective runs here.

An update of several averages writes them one after another: an exception that stops it part
way (an interrupt, out of memory) leaves some moved and others not, so it marks the average
torn, as a write seen in the background does (below).

In the background (``background.py``) it also checks that nothing wrote the local shards while
the thread read them: each tensor's version counter, which every in-place write through the
tensor moves (``copy_``, ``load_state_dict``, an update under ``no_grad``; a DTensor parameter
and its local shard each keep their own), is read when ``update()`` hands the update off and
again when the reads are over. A moved counter marks the average torn (``torn``): the update
averaged a mix of old and new values, so every later use of the average is refused until it is
restored (``forget``). Writes that bypass the counters (through ``.data``, or by pointer, as
non-torch kernels do) are not seen.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import torch

from ..base import deferred
from ..base.dist import rank
from ..base.errors import NonFiniteError
from ..rules import LerpRule, Rule
from ..strategies import Strategy
from ..strategies.dtensor import is_dtensor, local_shard
from .background import Background
from .check import SKIP, Decision, NonFiniteCheck
from .fused import (
    Step,
    UpdateGroup,
    Verdict,
    apply,
    apply_masked,
    data_ptr,
    group_tensors,
    groups_current,
    nonfinite,
    screen_on_device,
    stage_gathered,
    to_host,
)
from .kernels import to_device
from .options import Options, Role
from .staging import Stager

MAX_PENDING = 64  # updates whose non-finite verdict the host may not have read yet


class Given(NamedTuple):
    """The loop's verdict on its step (``update(finite=...)``), taken when ``update()`` is called, so
    that the loop may reuse its tensor at once: ``ok`` a Python bool, or a 0-d bool tensor of its
    own on the device the loop computed it on (read by the host only where that is free, the CPU,
    or where the update reads its verdicts on the host anyway); ``shown`` names it in the warning
    of the update it skips, should it be false."""

    ok: bool | torch.Tensor
    shown: str

    def known(self) -> bool | None:
        """Its value where the host can read it for free (a Python bool, a CPU tensor), else None."""
        if isinstance(self.ok, bool) or self.ok.device.type == "cpu":
            return bool(self.ok)
        return None


TRUE = Given(True, "True")  # a true verdict read on the host (its name is shown only when false)
FALSE = Given(False, "False")


def taken(finite: object, on_host: bool = False) -> Given | None:
    """``update(finite=...)`` checked and taken: a bool, a 0-d bool tensor, or a floating tensor whose
    elements are all finite (a total gradient norm); None: no verdict. No host read: a tensor's
    verdict is a new 0-d bool tensor on its device (a copy: the loop may overwrite its own), except
    with ``on_host`` for a tensor on the CPU, read at once as a Python bool (where the update reads
    its verdict on the host anyway). The usual ones, a bool and a 0-d or one-element floating CPU
    tensor, are read by the fewest calls (a tensor: one ATen call, ``item()``) into a verdict made
    once (``TRUE``): an update runs just after the optimizer (or another update) streamed the
    weights through the caches, so each distinct call here costs 2-30 us instead of 0.1-1
    (measured on a 2-core Xeon: ``item()`` 27 us cold, a call that does nothing 5, the general
    checks below 113).

    Raises:
        TypeError: Anything else (an int, a float, an integer tensor).
        ValueError: A bool tensor of more than one element, an empty tensor, or a DTensor that is
            not replicated (FSDP2's ``clip_grad_norm_`` returns a partial one).
    """
    if finite is None or finite is True or finite is False:
        return None if finite is None else TRUE if finite else FALSE
    if on_host and type(finite) is torch.Tensor and finite.is_cpu and finite.numel() == 1:  # (a plain tensor)
        value = finite.item()  # (a bool or an int falls through to the checks below)
        if type(value) is float:
            return TRUE if math.isfinite(value) else Given(False, _nonfinite_shown(finite))
    if not isinstance(finite, torch.Tensor) or not (finite.dtype == torch.bool or finite.dtype.is_floating_point):
        kind = f"a {finite.dtype} tensor" if isinstance(finite, torch.Tensor) else type(finite).__name__
        raise TypeError(
            f"update(finite=...) takes a bool, a 0-d bool tensor or a floating tensor (the total gradient norm), "
            f"got {kind}" + (" (a Python number: pass math.isfinite(x))" if isinstance(finite, float) else "")
        )
    if is_dtensor(finite):
        if not all(placement.is_replicate() for placement in finite.placements):  # type: ignore[attr-defined]
            raise ValueError(
                f"update(finite=...) got a DTensor placed {tuple(finite.placements)}: each rank holds part of its "  # type: ignore[attr-defined]
                "value; pass its full_tensor() (a collective, which update() never runs)"
            )
        finite = local_shard(finite)
    if finite.is_meta:
        raise ValueError(
            "update(finite=...) got a tensor on the meta device, which holds no value: pass the verdict computed "
            "where the gradients are (the norm clip_grad_norm_ returned for the materialised model)"
        )
    if finite.numel() == 0 or (finite.dtype == torch.bool and finite.dim() != 0):
        raise ValueError(
            f"update(finite=...) got a {finite.dtype} tensor of shape {tuple(finite.shape)}: a verdict is a 0-d "
            "bool tensor, or a non-empty floating tensor whose elements are all finite"
        )
    shown = "tensor(False)" if finite.dtype == torch.bool else _nonfinite_shown(finite)
    if on_host and finite.device.type == "cpu":
        if finite.numel() == 1:
            value = finite.item()
            return Given(value if isinstance(value, bool) else math.isfinite(value), shown)
        return Given(bool(torch.isfinite(finite).all()), shown)
    with torch.no_grad():
        if finite.dtype == torch.bool:
            return Given(finite.clone(), shown)
        return Given(torch.isfinite(finite).all(), shown)


def _nonfinite_shown(finite: torch.Tensor) -> str:
    return f"a {finite.dtype} tensor holding NaN or infinity"


class Issued(NamedTuple):
    """An update issued on the device with its verdicts left there, read by ``settle`` in order."""

    step: int
    ordinal: int  # its place among the due updates (``Updater.ordinal``)
    screened: list[Verdict] | None  # the screen's, per device; None where the loop's verdict stood in for it
    given: Verdict | None  # the loop's verdict as a tensor: one flag, true where it was false (``to_host``)
    shown: str  # how the loop's verdict is named, should it be false


class Averaged(Protocol):
    """What an ``Updater`` works on (``AverageState`` is one): the tensors and their views, the
    averages, the settings, and the counters it alone counts."""

    infos: list
    strategy: Strategy
    live: list[torch.Tensor]
    roles: list[Role]
    averages: dict
    options: Options
    step: int
    num_updates: int
    num_skipped: int

    def current_views(self) -> list[torch.Tensor]: ...

    def adopt(self, live: list[torch.Tensor]) -> None: ...


class Updater:
    """The update of one ``AverageState``. Its public attributes are for tests and tools:
    ``groups`` (the fused groups, the same objects while nothing changes), ``stager``,
    ``pending`` (updates whose device-side verdict is not read yet), ``on_device`` (None: keep
    the non-finite check on the device, its verdict read later, where the update's kernel runs
    there; True or False to choose; see ``check_on_device``), ``kernel_devices`` (the device
    types whose groups run the Triton kernel where it is available) and
    ``torn`` (why the average cannot be trusted, once a background update saw a write it did not
    wait for, or an update stopped part way; None while it can) and ``check`` (the non-finite
    check's trust and screen schedule, ``check.py``)."""

    kernel_devices: frozenset[str] = frozenset({"cuda"})

    def __init__(self, state: Averaged) -> None:
        self.state = state
        self.background = Background() if state.options.background else None
        self.buffer_copies: dict[int, torch.Tensor] = {}  # in the background: the buffers as update() found them
        self.copied_pointers: list[int] = []  # where the buffers copied into them were
        self.followed: list[torch.Tensor] | None = None  # the local shards' list last checked by follow()
        self.watched: list[torch.Tensor] = []  # in the background: what the thread reads, by version counter
        self.watched_names: list[str] = []  # the tensor each belongs to
        self.torn: str | None = None
        self.groups: list[UpdateGroup] = []
        self.kernel_grouped = False  # whether a group ran the Triton kernel when grouped (``may_mask``)
        self._regroup()
        self.guard_forwards()
        self.stager = Stager()  # staging buffers for offloaded shadows and casts, kept between updates
        self.on_device: bool | None = None
        # The check on an accelerator: verdicts not yet read, by step; each lerp rule's weights by
        # update count; the update count itself, and the flag that the weights are vouched for
        # (``NonFiniteCheck.vouched``, whose mirror it is), as device tensors.
        self.pending: deque[Issued] = deque()
        self.weight_tables: dict[tuple, torch.Tensor] = {}
        self.device_counters: dict[torch.device, torch.Tensor] = {}
        self.vouched_flags: dict[torch.device, torch.Tensor] = {}
        self.check = NonFiniteCheck(state.options)

    # ------------------------------------------------------------------ the update

    def update(self, step: int | None, finite: object = None) -> bool:
        """Take ``step`` (one more than the last when None) and the loop's verdict on it (``finite``,
        see ``taken``); average the local shards in when the step is due. Returns whether an update
        was applied (in the background: started)."""
        # (taken at once: the loop may reuse its tensor; refused, nothing changed)
        given = taken(finite, on_host=not self.may_mask())
        self.wait()
        self.require_whole("update()")
        self.settle(block=False)  # (earlier updates' verdicts already on the host: raised at the loop's next call)
        state = self.state
        previous = state.step
        state.step = self.next_step(step)
        self.check.stepped(previous, state.step)
        if not state.options.due(state.step):
            if self.check.between(None if given is None else given.known()):
                self._screen_between(given)  # type: ignore[arg-type] (a false verdict, read)
            return False
        with torch.no_grad():
            self.follow(state.current_views())
            if self.background is None:
                return self._average(given)
            self._copy_buffers()
        devices = (group.live_tensors[0].device for group in self.groups)
        self.background.start(state.step, functools.partial(self._average, given), devices, self._unwritten(state.step))
        return True

    def _copy_buffers(self) -> None:
        """In the background: the buffers as ``update()`` finds them, which the next forward may
        write before the thread reads them."""
        if self.buffer_copies:
            torch._foreach_copy_(list(self.buffer_copies.values()), [self.state.live[i] for i in self.buffer_copies])

    def wait(self) -> None:
        """Collect the update running in the background, if any (raising what it raised)."""
        if self.background is not None:
            self.background.wait()

    def require_whole(self, what: str) -> None:
        """Refuse ``what`` while the average is torn (a background update read weights being written)."""
        if self.torn is not None:
            raise RuntimeError(
                f"{what} refused: the average cannot be trusted, {self.torn}; restore it first "
                "(load(), load_state_dict() or restart(step))"
            )

    def guard_forwards(self) -> None:
        """In the background: the forwards that write the model's parameters wait for the update."""
        if self.background is not None:
            self.background.guard(self.state.strategy.model.modules())

    def _unwritten(self, step: int) -> Callable[[], None]:
        """The check that nothing wrote what the update of ``step`` reads, its versions read now."""
        watched, names = self.watched, self.watched_names
        before = [tensor._version for tensor in watched]

        def verify() -> None:
            after = [tensor._version for tensor in watched]
            if after == before:
                return
            written = list(dict.fromkeys(name for name, old, new in zip(names, before, after) if old != new))
            self.torn = f"{written} were written while the background update of step {step} read them on rank {rank()}"
            raise RuntimeError(
                f"{self.torn}, by something it does not wait for (model.load_state_dict, a hand-written update, an "
                "optimizer that is not a torch.optim.Optimizer): that update averaged a mix of their old and new "
                "values, so the average is refused until restored (load(), load_state_dict() or restart(step)); "
                "call avg.wait() before writing the live weights other than through an optimizer's step()"
            )

        return verify

    def _average(self, given: Given | None) -> bool:
        """The update of a due step, its groups current: checked (by the screen, the loop's
        verdict ``given``, or both), applied and counted."""
        with torch.no_grad():  # (per thread: this may run on the background's)
            if given is not None and type(given.ok) is not bool:  # (a bool, the usual case: nothing to read)
                given = self._read_where_free(given)
            on_device = self.check_on_device(given)
            if given is not None and type(given.ok) is not bool and not on_device:  # (read here, as the screen's is)
                given = Given(bool(given.ok), given.shown)
            decision = self.check.due(None if given is None else given.ok)
            if decision is SKIP:  # (the check off: nothing to read or write, nor to wait for)
                self._refused(given.shown, self.state.step, "skipping")  # type: ignore[union-attr]
                return False
            if on_device:
                with self._whole_or_torn():
                    self._apply_on_device(given, decision)
                return True
            self.settle()  # (nothing pending unless the model just left its accelerator)
            stage_gathered(self.groups)  # the small shards that lie apart, into one buffer per group
            if decision.screen and self._skip_nonfinite(given):
                return False
            if not decision.apply:  # (a false verdict, its weights screened finite)
                self._refused(given.shown, self.state.step, "skipping")  # type: ignore[union-attr]
                return False
            with self._whole_or_torn():
                self._apply()
        self._counted()
        return True

    @contextlib.contextmanager
    def _whole_or_torn(self) -> Iterator[None]:
        """The averages' writes of one update, all of them or a torn mark: an exception that stops
        them part way (an interrupt between two kernels, out of memory) leaves some averages or
        tensors moved and others not, which no count can say, so every later use of the average is
        refused until it is restored (``require_whole``)."""
        try:
            yield
        except BaseException as error:
            self.torn = (
                f"the update of step {self.state.step} on rank {rank()} stopped part way ({type(error).__name__}), "
                "leaving some averages or tensors updated and others not"
            )
            raise

    def _read_where_free(self, given: Given) -> Given:
        """A tensor verdict ``given`` read on the host where that is free: on the CPU, for an update
        that runs elsewhere (moving it to the device would wait for the device instead)."""
        if given.ok.device.type != "cpu":  # type: ignore[union-attr]
            return given
        if all(group.live_tensors[0].device.type == "cpu" for group in self.groups):
            return given  # (the CPU standing in for a device: the verdict stays a tensor, as on CUDA)
        return Given(bool(given.ok), given.shown)

    def next_step(self, step: int | None) -> int:
        """The step of this update: steps only go forward, so no step is averaged in twice."""
        state = self.state
        if step is None:
            return state.step + 1
        if isinstance(step, bool):  # (an int to Python: True would be step 1)
            raise ValueError(f"update(step=...) takes the optimizer step, an int (or None), got {step!r}")
        step = operator.index(step)
        seen = state.step > 0 or state.num_updates > 0 or state.num_skipped > 0
        if step < 0 or step < state.step or (step == state.step and seen):
            raise ValueError(
                f"update(step={step}) after step {state.step}: steps must increase (call update() once per "
                "optimizer step; a run restarted from an earlier checkpoint first restores the averager saved "
                "with it, through load() or dcp.load)"
            )
        return step

    def _counted(self, applied: bool = True) -> None:
        """The one place an update is counted: applied (the device counters move with it) or skipped."""
        if applied:
            self.state.num_updates += 1
            for counter in self.device_counters.values():
                counter.add_(1)
        else:
            self.state.num_skipped += 1

    def _skipped(self, warning: str | None) -> None:
        """The one way an update is skipped, for whatever reason: counted, and ``warning`` (None:
        silently) given as a ``RuntimeWarning``, at once, or from the background's thread at the
        call that collects the update, in the loop's thread."""
        if warning is not None:  # (at the loop's line that called update(), or whatever settled it)
            deferred.warn(RuntimeWarning(warning))
        self._counted(applied=False)

    def _apply(self) -> None:
        state = self.state
        for group in self.groups:
            if state.num_updates == 0 or group.role == "copy":
                steps: list[Step] = [None] * len(group.shadows)
            else:
                steps = [self._step(average.rule, group) for average in state.averages.values()]
            apply(group, steps, self.stager, gathered_staged=True)

    def _step(self, rule: Rule, group: UpdateGroup) -> Step:
        if isinstance(rule, LerpRule):
            return rule.weight(self.state.num_updates)
        return rule.fn, self._counter(group)  # type: ignore[attr-defined]

    def _counter(self, group: UpdateGroup) -> torch.Tensor:
        """``num_updates`` as a tensor on the group's device, kept there and incremented in place."""
        device = group.shadows[0][0].device
        if device not in self.device_counters:
            self.settle()  # the count must be exact when it moves to the device
            self.device_counters[device] = to_device(torch.tensor(self.state.num_updates), device)
        return self.device_counters[device]

    # ------------------------------------------------------------------ the non-finite check

    def _refused(self, shown: str, step: int, verb: str) -> None:
        """Skip the update of ``step``, which the loop's verdict ``shown`` said was not finite: a
        skipped optimizer step (a loss scaler's overflow) or non-finite gradients. A warning, not an
        error, whatever ``on_nonfinite`` says (a run with a loss scaler skips steps routinely; the
        weights were screened at that step, and found finite, before this is called); silent under
        ``"off"``."""
        warning = (
            f"{verb} the update at step {step} on rank {rank()}: the loop's verdict was false (finite={shown}): its "
            "optimizer step was skipped (a loss scaler's overflow) or its gradients were not finite"
        )
        self._skipped(None if self.state.options.on_nonfinite == "off" else warning)

    def _skip_nonfinite(self, given: Given | None) -> bool:
        """Screen every local shard the update reads, on the host, and tell the check what it found;
        where a shard is not finite raise, or warn and return True to skip (``given``: the loop's
        verdict on the step, named in both where it was false)."""
        state = self.state
        bad = [state.infos[index].name for index in nonfinite(self.groups)]
        self.check.screened(clean=not bad)
        if not bad:
            return False
        self._nonfinite_found(bad, state.step, None if given is None or given.ok is not False else given.shown)
        return True

    def _screen_between(self, given: Given) -> None:
        """The screen at a step no update is due at, whose verdict (``given``) was false: its
        optimizer may have written NaN, which the next verdicts would not see."""
        state = self.state
        with torch.no_grad():
            self.follow(state.current_views())
            self.settle()
            if self.background is not None:
                self._copy_buffers()
            stage_gathered(self.groups)
            bad = [state.infos[index].name for index in nonfinite(self.groups)]
        self.check.screened(clean=not bad)
        if bad:
            self._nonfinite_found(bad, state.step, given.shown, due=False)

    def may_mask(self) -> bool:
        """Whether an update may be masked on the device by a verdict left there (``check_on_device``):
        where a group ran the Triton kernel when grouped (``kernel_grouped``; a kernel that failed
        since leaves this true, and ``check_on_device`` then finds no group runs it), or the masked
        ATen path is chosen (``on_device``). Read at every update that takes a verdict, so it reads
        no group: with the caches cold each call costs microseconds (see ``taken``)."""
        return self.on_device is True or self.kernel_grouped

    def check_on_device(self, given: Given | None = None) -> bool:
        """Whether the non-finite check (the screen, or the loop's verdict ``given``) stays on the
        device, its verdict read by the host later, so that ``update()`` never waits for the
        device: with the check on (or a verdict on the device to mask the update by, even under
        ``"off"``), built-in rules only, from the second update on (the first reads its verdict on
        the host), and by default (``on_device`` None) where every group runs the Triton kernel
        (CUDA), which skips the update on the device's flag in the same pass. Elsewhere a masked
        update costs a scratch and a second kernel per piece: measured on an H200
        (docs/benchmarks.md), more than the host's one wait per update, so the host reads one flag
        per group there."""
        if not self.may_mask():  # (the host's check, the CPU's: decided by the fewest calls, see taken)
            return False
        state = self.state
        on_device_verdict = given is not None and isinstance(given.ok, torch.Tensor)
        if (state.options.on_nonfinite == "off" and not on_device_verdict) or state.num_updates == 0:
            return False
        if not all(isinstance(average.rule, LerpRule) for average in state.averages.values()):
            return False
        if self.on_device is None:
            floating = [g for g in self.groups if g.live_tensors[0].dtype.is_floating_point]
            return bool(floating) and all(group.kernel for group in floating)
        return self.on_device

    def _apply_on_device(self, given: Given | None, decision: Decision) -> None:
        """The update with the non-finite check left on the device, so that the host never waits:
        screened (as ``decision`` says), masked, and counted there; its verdicts are read later
        (``settle``). It is applied where the loop's verdict ``given`` is true and the weights are
        vouched for: by this update's screen, or else by the device's ``vouched`` flag (no verdict
        issued there was false since the last clean screen; ``NonFiniteCheck.settled`` mirrors it).
        With the check off, the verdict alone masks it."""
        state = self.state
        if len(self.pending) >= MAX_PENDING:  # (a device far behind: wait for its oldest verdicts)
            self.settle()
        verdicts, oks = screen_on_device(self.groups) if decision.screen else ([], {})
        (live_device,) = {group.live_tensors[0].device for group in self.groups}
        said = None  # the loop's verdict as a device flag (None: none, or a true one read on the host)
        if isinstance(given, Given) and isinstance(given.ok, torch.Tensor):
            said = given.ok.to(live_device)  # (a device's own, or the CPU standing in for one: no copy)
        elif given is not None and given.ok is False:  # (read on the host: the same mask)
            said = torch.zeros((), dtype=torch.bool, device=live_device)
        if state.options.on_nonfinite == "off":
            ok = self._ones(live_device) if said is None else said
        else:
            vouched = self.vouched_flags.get(live_device)
            if vouched is None:
                vouched = self.vouched_flags[live_device] = self._ones(live_device).clone()
            weights_ok = oks.get(live_device, self._ones(live_device)) if decision.screen else vouched
            ok = weights_ok if said is None else weights_ok & said
            vouched.copy_(weights_ok if decision.screen else ok)
        loop = None if said is None else to_host((~said).view(1), [])
        for group in self.groups:
            ok_here = ok.to(group.shadows[0][0].device)  # offloaded shadows: the host waits for the flag
            counter = self._counter(group)
            if group.role == "copy":
                weights: list[torch.Tensor | None] = [None]
            else:
                dtype = torch.promote_types(group.shadows[0][0].dtype, torch.float32)  # as ATen's opmath
                weights = [self._weight(name, counter, dtype) for name in state.averages]
            apply_masked(group, ok_here, weights, self.stager)
        for device, counter in self.device_counters.items():
            counter.add_(ok.to(device))
        shown = "" if given is None else given.shown
        self.pending.append(Issued(state.step, self.check.ordinal, verdicts if decision.screen else None, loop, shown))

    @staticmethod
    def _ones(device: torch.device) -> torch.Tensor:
        """A true 0-d flag on ``device`` (no floating shard there to screen: nothing to find)."""
        return torch.ones((), dtype=torch.bool, device=device)

    def _weight(self, name: str | None, counter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Average ``name``'s lerp weight after ``counter`` updates (a device tensor), looked up on
        the device in a table the host extends before the count can outgrow it. In ``dtype``: at
        least fp32, as ATen takes a Python float weight (rounded once, from the double)."""
        key = (name, counter.device, dtype)
        table = self.weight_tables.get(key)
        needed = self.state.num_updates + len(self.pending) + 1
        if table is None or table.numel() <= needed:
            rule = self.state.averages[name].rule
            weights = [1.0] + [rule.weight(n) for n in range(1, 2 * needed + 64)]  # type: ignore[attr-defined]
            table = self.weight_tables[key] = to_device(torch.tensor(weights, dtype=dtype), counter.device)
        return table.index_select(0, counter.view(1))

    def settle(self, block: bool = True) -> None:
        """Read the verdicts of updates checked on the device, in order, and tell the check
        (``NonFiniteCheck.settled``): count each one applied, or (the device left the average
        untouched) skip it as the loop's false verdict says, or as the device's ``vouched`` flag
        did, or (non-finite live values) raise or warn as the ``on_nonfinite`` policy says. Without ``block`` only
        verdicts already on the host are read: a CPU's at once (computed there, it has no event), an
        accelerator's once its event says its copy landed, so that ``update()`` reads what it can of
        the earlier ones and never waits."""
        while self.pending:
            issued = self.pending[0]
            verdicts = [*(issued.screened or []), *([issued.given] if issued.given is not None else [])]
            if not block and any(v.event is not None and not v.event.query() for v in verdicts):
                return
            for verdict in verdicts:
                if verdict.event is not None:
                    verdict.event.synchronize()
            self.pending.popleft()
            screened = issued.screened or []
            bad = [self.state.infos[i].name for v in screened for i, flag in zip(v.indices, v.bad.tolist()) if flag]
            refused = issued.given is not None and bool(issued.given.bad[0])
            clean = None if issued.screened is None else not bad
            outcome = self.check.settled(issued.step, issued.ordinal, clean, refused)
            if outcome == "applied":
                self.state.num_updates += 1  # (the device counters moved already, on the device)
            elif outcome == "refused":
                self._refused(issued.shown, issued.step, "skipped")
            elif outcome == "unvouched":
                self._skipped(
                    f"skipped the update at step {issued.step} on rank {rank()}: it was issued on the device before "
                    f"the host read the loop's false verdict of step {self.check.unvouched_at}, and masked there "
                    "until a screen finds the weights finite (the next update issued screens them)"
                )
            else:
                self._nonfinite_found(bad, issued.step, issued.shown if refused else None, on_device=True)

    def _nonfinite_found(
        self, bad: list[str], step: int, refused: str | None, due: bool = True, on_device: bool = False
    ) -> None:
        """The ``on_nonfinite`` policy for step ``step``, whose local shards ``bad`` a screen found not
        finite: raise, or warn and count its update skipped (``due``; at a step between updates
        there is none). ``refused`` names the loop's verdict where it was false on that step (the
        usual way there: ``clip_grad_norm_`` scales infinite gradients by 1/inf = 0, inf * 0 is NaN,
        and the optimizer writes it); ``on_device``: the screen ran on the device, read later."""
        where = f"at step {step} on rank {rank()}" + ("" if due else " (between updates)")
        after = (
            ""
            if refused is None
            else f", after the loop's verdict on that step was false (finite={refused}): a step with non-finite "
            "gradients writes NaN (clip_grad_norm_ scales them by 1/inf = 0, and inf * 0 is NaN)"
        )
        if self.state.options.on_nonfinite == "raise":
            held = (
                " (found on the device after the update was issued: that update was masked out there, the average "
                "holds the others; "
                if on_device
                else "; the average was not updated ("
            )
            raise NonFiniteError(
                f"non-finite live values in {bad} {where}{after}{held}on_nonfinite='skip' skips such updates instead, "
                "screening each until the weights are finite)"
            )
        verb = "skipped" if on_device else "skipping"
        until = "" if refused is None else "; every update is screened until they are finite"
        warning = (
            f"{verb} the update {where}: non-finite live values in {bad}{after}{until}"
            if due
            else f"non-finite live values in {bad} {where}{after}{until}"
        )
        if due:
            self._skipped(warning)
        else:
            deferred.warn(RuntimeWarning(warning))

    def forget(self) -> None:
        """Drop what the device holds of the counts and flags, and a torn mark, and trust no verdict
        before a screen: the state was just restored."""
        self.device_counters.clear()
        self.vouched_flags.clear()
        self.pending.clear()
        self.torn = None
        self.check.restored()

    # ------------------------------------------------------------------ grouping

    def follow(self, live: list[torch.Tensor]) -> None:
        """Regroup only when a view is a new object or its data moved (a cast, ``model.to``). The very
        list followed last time needs no look: a strategy hands it back only when nothing in it
        moved (``Strategy.local_shards``)."""
        if live is self.followed:
            return
        if (
            not all(map(operator.is_, live, self.state.live))
            or not groups_current(self.groups)
            or [data_ptr(live[index]) for index in self.buffer_copies] != self.copied_pointers
        ):
            self.state.adopt(live)
            self._regroup()
            self.check.distrust()  # (new live tensors: new values, perhaps, that no verdict has seen)
        self.followed = live

    def _regroup(self) -> None:
        """The fused groups made anew (``groups``), and whether one runs the Triton kernel."""
        self.groups = self._group()
        self.kernel_grouped = any(group.kernel for group in self.groups)

    def _group(self) -> list[UpdateGroup]:
        """The fused groups; in the background the stored buffers are read from their copies."""
        state = self.state
        live_tensors = state.live
        if self.background is not None:
            buffers = [i for i, info in enumerate(state.infos) if info.kind == "buffer" and state.roles[i] != "live"]
            self.buffer_copies = {index: torch.empty_like(state.live[index]) for index in buffers}
            self.copied_pointers = [data_ptr(state.live[index]) for index in buffers]
            live_tensors = [self.buffer_copies.get(index, live) for index, live in enumerate(state.live)]
            self._watch()
        shadow_sets = [a.shadows for a in state.averages.values()]
        return group_tensors(state.roles, shadow_sets, live_tensors, self.kernel_devices)

    def _watch(self) -> None:
        """What the thread reads of the live model, to check by version counter: each local shard
        it reads (the buffers are read from their copies), and the DTensor parameter around it,
        through which ``load_state_dict`` and updates under ``no_grad`` write."""
        state = self.state
        wrappers = {id(local_shard(p)): p for p in state.strategy.model.parameters() if is_dtensor(p)}
        read = [i for i, role in enumerate(state.roles) if role != "live" and i not in self.buffer_copies]
        pairs = [(state.live[i], i) for i in read]
        pairs += [(wrappers[id(state.live[i])], i) for i in read if id(state.live[i]) in wrappers]
        self.watched = [tensor for tensor, _ in pairs]
        self.watched_names = [state.infos[index].name for _, index in pairs]
