"""The update pipeline, in one place: what ``WeightAverager.update()`` does to the shadows.

An ``Updater`` keeps the state's live views grouped for the fused kernels (``fused.py``) and
regroups them only when the engine really changed them; it stages live shards for offloaded
shadows and casts (``staging.py``); it screens them for NaN and infinity, on the host, or on an
accelerator without a host read (the verdicts read later, ``settle``); it looks up each rule's
weight; and it is the one place that counts an update, applied or skipped. No collective runs
here.

In the background (``background.py``) it also checks that nothing wrote the live shards while
the thread read them: each tensor's version counter, which every in-place write through the
tensor moves (``copy_``, ``load_state_dict``, an update under ``no_grad``; a DTensor parameter
and its local shard each keep their own), is read when ``update()`` hands the update off and
again when the reads are over. A moved counter marks the average torn (``torn``): the update
averaged a mix of old and new values, so every later use of the average is refused until it is
restored (``forget``). Writes that bypass the counters (through ``.data``, or by pointer, as
non-torch kernels do) are not seen.
"""

from __future__ import annotations

import operator
import warnings
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from ..base.dist import rank
from ..base.errors import NonFiniteError
from ..rules import LerpRule, Rule
from ..strategies import Strategy
from ..strategies.dtensor import is_dtensor, local_view
from .background import Background
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
)
from .kernels import to_device
from .options import Options, Role
from .staging import Stager

MAX_PENDING = 64  # updates whose non-finite verdict the host may not have read yet


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
    ``torn`` (in the background: why the average cannot be trusted, once a write it did not wait
    for was seen; None while it can)."""

    kernel_devices: frozenset[str] = frozenset({"cuda"})

    def __init__(self, state: Averaged) -> None:
        self.state = state
        self.background = Background() if state.options.background else None
        self.snapshots: dict[int, torch.Tensor] = {}  # in the background: the buffers as update() found them
        self.snapshot_pointers: list[int] = []  # where the buffers copied into them were
        self.watched: list[torch.Tensor] = []  # in the background: what the thread reads, by version counter
        self.watched_names: list[str] = []  # the tensor each belongs to
        self.torn: str | None = None
        self.groups: list[UpdateGroup] = self._group()
        self.guard_forwards()
        self.stager = Stager()  # staging buffers for offloaded shadows and casts, kept between updates
        self.on_device: bool | None = None
        # The check on an accelerator: verdicts not yet read, by step; each lerp rule's weights by
        # update count; the update count itself, as device tensors.
        self.pending: deque[tuple[int, list[Verdict]]] = deque()
        self.weight_tables: dict[tuple, torch.Tensor] = {}
        self.device_counters: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ the update

    def update(self, step: int | None) -> bool:
        """Take ``step`` (one more than the last when None); average the live shards in when the
        step is due. Returns whether an update was applied (in the background: started)."""
        self.wait()
        self.require_whole("update()")
        self.settle(block=False)  # (earlier updates' verdicts already on the host: raised at the loop's next call)
        state = self.state
        state.step = self.next_step(step)
        if not state.options.due(state.step):
            return False
        with torch.no_grad():
            self.follow(state.current_views())
            if self.background is None:
                return self._average()
            if self.snapshots:  # what the next forward may write before the update reads it
                torch._foreach_copy_(list(self.snapshots.values()), [state.live[i] for i in self.snapshots])
        devices = (group.live_tensors[0].device for group in self.groups)
        self.background.start(state.step, self._average, devices, self._unwritten(state.step))
        return True

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

    def _average(self) -> bool:
        """The update of a due step, its groups current: checked, applied and counted."""
        with torch.no_grad():  # (per thread: this may run on the background's)
            if self.check_on_device():
                self._apply_on_device()
                return True
            self.settle()  # (nothing pending unless the model just left its accelerator)
            stage_gathered(self.groups)  # the small shards that lie apart, into one buffer per group
            if self._skip_nonfinite():
                return False
            self._apply()
        self._counted()
        return True

    def next_step(self, step: int | None) -> int:
        """The step of this update: steps only go forward, so no step is averaged in twice."""
        state = self.state
        if step is None:
            return state.step + 1
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

    def _skip_nonfinite(self) -> bool:
        """Check every live shard the update reads, on the host; raise, or warn and return True to skip."""
        state = self.state
        if state.options.on_nonfinite == "off":
            return False
        bad = [state.infos[index].name for index in nonfinite(self.groups)]
        if not bad:
            return False
        self._nonfinite_found(
            bad,
            state.step,
            raised="non-finite live values in {bad} {where}; the average was not updated "
            "(on_nonfinite='skip' skips such updates instead)",
            warned="skipping the update {where}: non-finite live values in {bad}",
        )
        return True

    def check_on_device(self) -> bool:
        """Whether the non-finite check stays on the device, its verdict read by the host later,
        so that ``update()`` never waits for the device: with the check on, built-in rules only,
        from the second update on (the first reads its verdict on the host), and by default
        (``on_device`` None) where every group runs the Triton kernel (CUDA), which skips the
        update on the device's flag in the same pass. Elsewhere a masked update costs a scratch
        and a second kernel per piece: measured on an H200 (docs/benchmarks.md), more than the
        host's one wait per update, so the host reads one flag per group there."""
        state = self.state
        if state.options.on_nonfinite == "off" or state.num_updates == 0:
            return False
        if not all(isinstance(average.rule, LerpRule) for average in state.averages.values()):
            return False
        if self.on_device is None:
            floating = [g for g in self.groups if g.live_tensors[0].dtype.is_floating_point]
            return bool(floating) and all(group.kernel for group in floating)
        return self.on_device

    def _apply_on_device(self) -> None:
        """The update with the non-finite check left on the device: screened, masked and counted
        there, so the host never waits; its verdict is read later (``settle``)."""
        state = self.state
        if len(self.pending) >= MAX_PENDING:  # (a device far behind: wait for its oldest verdicts)
            self.settle()
        verdicts, oks = screen_on_device(self.groups)
        (live_device,) = {group.live_tensors[0].device for group in self.groups}
        ok = oks.get(live_device, torch.ones((), dtype=torch.bool, device=live_device))  # no floating shard: ok
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
        self.pending.append((state.step, verdicts))

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
        """Read the verdicts of updates checked on the device, in order: count each one applied,
        or (non-finite live values: the device left the average untouched) raise or warn as the
        ``on_nonfinite`` policy says. Without ``block`` only verdicts already on the host are read:
        a CPU's at once (computed there, it has no event), an accelerator's once its event says its
        copy landed, so that ``update()`` reads what it can of the earlier ones and never waits."""
        while self.pending:
            step, verdicts = self.pending[0]
            if not block and any(v.event is not None and not v.event.query() for v in verdicts):
                return
            for verdict in verdicts:
                if verdict.event is not None:
                    verdict.event.synchronize()
            self.pending.popleft()
            bad = [self.state.infos[i].name for v in verdicts for i, flag in zip(v.indices, v.bad.tolist()) if flag]
            if not bad:
                self.state.num_updates += 1  # (the device counters moved already, on the device)
                continue
            self._nonfinite_found(
                bad,
                step,
                raised="non-finite live values in {bad} {where} (found on the device after the update was issued: "
                "that update was masked out there, the average holds the others; on_nonfinite='skip' warns instead)",
                warned="skipped the update {where}: non-finite live values in {bad}",
            )

    def _nonfinite_found(self, bad: list[str], step: int, raised: str, warned: str) -> None:
        """The ``on_nonfinite`` policy for an update whose live shards ``bad`` were not finite:
        raise ``raised``, or warn ``warned`` and count the update skipped."""
        where = f"at step {step} on rank {rank()}"
        if self.state.options.on_nonfinite == "raise":
            raise NonFiniteError(raised.format(bad=bad, where=where))
        warning = RuntimeWarning(warned.format(bad=bad, where=where))
        if self.background is not None and self.background.running_here():
            self.background.defer(warning)  # (given in the loop's thread, at the call that collects this update)
        else:
            warnings.warn(warning, stacklevel=5)
        self._counted(applied=False)

    def forget(self) -> None:
        """Drop what the device holds of the counts, and a torn mark: the state was just restored."""
        self.device_counters.clear()
        self.pending.clear()
        self.torn = None

    # ------------------------------------------------------------------ grouping

    def follow(self, live: list[torch.Tensor]) -> None:
        """Regroup only when a view is a new object or its data moved (a cast, ``model.to``)."""
        if (
            not all(map(operator.is_, live, self.state.live))
            or not groups_current(self.groups)
            or [data_ptr(live[index]) for index in self.snapshots] != self.snapshot_pointers
        ):
            self.state.adopt(live)
            self.groups = self._group()

    def _group(self) -> list[UpdateGroup]:
        """The fused groups; in the background the stored buffers are read from their snapshots."""
        state = self.state
        live_tensors = state.live
        if self.background is not None:
            buffers = [i for i, info in enumerate(state.infos) if info.kind == "buffer" and state.roles[i] != "live"]
            self.snapshots = {index: torch.empty_like(state.live[index]) for index in buffers}
            self.snapshot_pointers = [data_ptr(state.live[index]) for index in buffers]
            live_tensors = [self.snapshots.get(index, live) for index, live in enumerate(state.live)]
            self._watch()
        shadow_sets = [a.shadows for a in state.averages.values()]
        return group_tensors(state.roles, shadow_sets, live_tensors, self.kernel_devices)

    def _watch(self) -> None:
        """What the thread reads of the live model, to check by version counter: each live shard
        it reads (the buffers are read from their snapshots), and the DTensor parameter around it,
        through which ``load_state_dict`` and updates under ``no_grad`` write."""
        state = self.state
        wrappers = {id(local_view(p)): p for p in state.strategy.model.parameters() if is_dtensor(p)}
        read = [i for i, role in enumerate(state.roles) if role != "live" and i not in self.snapshots]
        pairs = [(state.live[i], i) for i in read]
        pairs += [(wrappers[id(state.live[i])], i) for i in read if id(state.live[i]) in wrappers]
        self.watched = [tensor for tensor, _ in pairs]
        self.watched_names = [state.infos[index].name for _, index in pairs]
