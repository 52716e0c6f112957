"""``AverageState``: the averager's tensors and counters, and the one interface the I/O modules use.

``WeightAverager`` (``averager.py``) builds an ``AverageState`` and drives it (``update``,
``swapped``); checkpoints (``checkpoint.py``), DCP (``stateful.py``) and export (``export.py``)
read and restore it through the attributes and methods documented here, and nothing else:

- ``infos``, ``roles``, ``layout``: what each tensor is, whether it is averaged, copied or not
  stored, and which rank holds which part of it;
- ``averages``: the averages kept, by name (``None`` for an averager built with one rule), each
  with its rule and its shadows on this rank (copied tensors share one shadow across averages);
- ``stored(i)``, ``keys(i)`` and ``piece(i, name)``: whether tensor ``i`` has shadows, the keys
  its values are saved under, and this rank's part of it as saved or exported;
- ``check_current()`` before collective I/O, ``gathered(dst)`` for full tensors;
- ``describe()`` and ``restore(description, saved)`` for everything but the tensors' values.

It also keeps the cached local views current: the adapter's views are grouped once for fused
updates and regrouped only when the engine really changed them.
"""

from __future__ import annotations

import operator
import re
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import ModelChangedError, NonFiniteError
from .layout import DEFAULT_BUCKET_BYTES, ShardLayout, distributed, iter_gathered, rank, world_size
from .rules import LerpRule, Rule
from .staging import Stager
from .storage import dtype_name
from .strategies import Strategy
from .strategies.base import TensorInfo
from .update import Role, UpdateGroup, Verdict, group_tensors, groups_current

MAX_PENDING = 64  # updates whose non-finite verdict the host may not have read yet

FORMAT, VERSION = "shardavg", 5  # the description's format, shared by checkpoints, DCP and exports
# (2: checksummed; 3: "averages", several named averages, in place of one "rule"; 4: a checkpoint's
# manifest records its save's id and every file's size and SHA-256; 5: chunks are boxes of the
# tensor, not ranges of the flattened tensor, and DCP holds each tensor in its own shape)
AVERAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")  # never a dot or a slash: names join keys


def tensor_key(average: str | None, name: str) -> str:
    """The key a tensor of an average is saved under: its name, prefixed by the average's name for
    averaged tensors of a named average (``"slow/fc.weight"``)."""
    return name if average is None else f"{average}/{name}"


@dataclass
class Average:
    """One average: its rule and its shadow of every local view (``None`` where not stored)."""

    name: str | None
    rule: Rule
    shadows: list[torch.Tensor | None]


@dataclass(frozen=True)
class Options:
    """The averager's settings (validated by ``WeightAverager``)."""

    every_n_steps: int
    start_step: int
    dtype: torch.dtype | None  # shadow dtype of averaged floating tensors; None keeps the live dtype
    buffers: str  # "copy" | "average" | "ignore"
    device: torch.device | None  # where shadows live; None next to each live shard
    include_frozen: bool
    on_nonfinite: str  # "raise" | "skip" | "off"

    def role(self, info: TensorInfo) -> Role:
        if info.kind == "param":
            return "average" if info.requires_grad or self.include_frozen else "live"
        if self.buffers == "ignore":
            return "live"
        if self.buffers == "average" and info.dtype.is_floating_point:
            return "average"
        return "copy"

    def describe(self) -> dict[str, Any]:
        return {
            "every_n_steps": self.every_n_steps,
            "start_step": self.start_step,
            "dtype": None if self.dtype is None else dtype_name(self.dtype),
            "buffers": self.buffers,
            "include_frozen": self.include_frozen,
        }


# Parameter, buffer and submodule registrations on a watched model mark its states for a full
# structure check at their next use (replacing `model.fc` or `model.fc.weight`).
_WATCHED: weakref.WeakSet[AverageState] = weakref.WeakSet()
_hooks_installed = False


def _on_registration(module: nn.Module, name: str, value: object) -> None:
    for state in list(_WATCHED):
        if id(module) in state._module_ids:
            state._structure_dirty = True


def _watch(state: AverageState) -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.nn.modules import module as module_hooks

        module_hooks.register_module_parameter_registration_hook(_on_registration)
        module_hooks.register_module_buffer_registration_hook(_on_registration)
        module_hooks.register_module_module_registration_hook(_on_registration)
        _hooks_installed = True
    _WATCHED.add(state)


class AverageState:
    """Shadows of this rank's local views (one set per average), the views themselves (grouped for
    fused updates), the layout of every tensor across ranks, and the counters, which all averages
    share. Building it is a collective."""

    def __init__(self, strategy: Strategy, rules: dict[str | None, Rule], options: Options) -> None:
        self.strategy = strategy
        self.options = options
        self.step = 0  # last step seen by update()
        self.num_updates = 0  # updates applied (the first one copies)
        self.num_skipped = 0  # updates skipped for non-finite live weights
        self.run_id: str | None = None  # which run wrote a checkpoint, when the user says (PostHocEMA does)
        self.device_counters: dict[torch.device, torch.Tensor] = {}  # num_updates as a tensor, per device
        self.gather_bucket_bytes = DEFAULT_BUCKET_BYTES
        # The check on an accelerator (see ``check_on_device``): verdicts not yet read, by step, and
        # each lerp rule's weights by update count, as device tensors.
        self.pending: deque[tuple[int, list[Verdict]]] = deque()
        self.weight_tables: dict[tuple, torch.Tensor] = {}
        self.deferred: bool | None = None  # None: on an accelerator; tests force the path on CPU
        self.stager = Stager()  # staging buffers for offloaded shadows and casts, kept between updates

        self.infos: list[TensorInfo] = strategy.tensors()
        self.live: list[torch.Tensor] = strategy.local_views()
        self.roles: list[Role] = [options.role(info) for info in self.infos]
        self.layout = ShardLayout.build(self.infos)
        self.averages: dict[str | None, Average] = {
            name: Average(name, rule, shadows)
            for (name, rule), shadows in zip(rules.items(), self._allocate(len(rules)))
        }
        self.groups: list[UpdateGroup] = self._group()
        self._module_ids = {id(module) for module in strategy.model.modules()}
        self._structure_dirty = False
        _watch(self)

    def _allocate(self, count: int) -> list[list[torch.Tensor | None]]:
        """``count`` sets of shadows carved from one zeroed slab per (device, dtype): the copied
        tensors once, shared by every set, then each set's averaged ones in order, so that shadows
        of neighbouring live shards are neighbours too and the update fuses them."""
        kinds: list[tuple | None] = []
        for role, live in zip(self.roles, self.live):
            dtype = live.dtype
            if role == "average" and live.dtype.is_floating_point and self.options.dtype is not None:
                dtype = self.options.dtype
            device = self.options.device or live.device
            kinds.append(
                None if role == "live" else (dtype, device, device.type == "cpu" and live.device.type == "cuda")
            )
        sizes: dict[tuple, int] = {}
        for kind, live, role in zip(kinds, self.live, self.roles):
            if kind is not None:
                sizes[kind] = sizes.get(kind, 0) + live.numel() * (count if role == "average" else 1)
        # zeros, not empty: a checkpoint saved before the first update must not carry stray memory
        slabs = {
            kind: torch.zeros(size, dtype=kind[0], device=kind[1], pin_memory=kind[2]) for kind, size in sizes.items()
        }
        offsets = dict.fromkeys(slabs, 0)

        def carve(role: Role) -> list[torch.Tensor | None]:
            shadows: list[torch.Tensor | None] = []
            for kind, live, its_role in zip(kinds, self.live, self.roles):
                if kind is None or its_role != role:
                    shadows.append(None)
                    continue
                start, offsets[kind] = offsets[kind], offsets[kind] + live.numel()
                shadows.append(slabs[kind][start : offsets[kind]].view(live.shape))
            return shadows

        copied = carve("copy")
        sets = [carve("average") for _ in range(count)]
        return [[c if a is None else a for a, c in zip(averaged, copied)] for averaged in sets]

    def _group(self) -> list[UpdateGroup]:
        return group_tensors(self.roles, [a.shadows for a in self.averages.values()], self.live)

    # ------------------------------------------------------------------ averages

    @property
    def names(self) -> list[str | None]:
        return list(self.averages)

    def average(self, name: str | None) -> Average:
        """The average called ``name``; ``None`` names the only one, when there is one."""
        if name is None and len(self.averages) == 1:
            return next(iter(self.averages.values()))
        if name not in self.averages:
            named = [n for n in self.averages if n is not None]
            if name is None:
                raise ValueError(f"this averager keeps several averages {named}: name one (average=...)")
            raise ValueError(
                f"no average called {name!r}: "
                + (f"this averager keeps {named}" if named else "this averager keeps one, unnamed (average=None)")
            )
        return self.averages[name]

    def stored(self, index: int) -> bool:
        """Whether tensor ``index`` has shadows (averaged or copied), rather than being exported live."""
        return self.roles[index] != "live"

    def keys(self, index: int) -> list[tuple[str, str | None]]:
        """``(key, average)`` under which tensor ``index`` is saved: one per average when averaged,
        one shared (average ``None``) when copied or live."""
        name = self.infos[index].name
        if self.roles[index] == "average":
            return [(tensor_key(average, name), average) for average in self.averages]
        return [(name, None)]

    # ------------------------------------------------------------------ live views

    def _rebind(self, live: list[torch.Tensor]) -> None:
        """Adopt the engine's current local views: shapes must not change; a new dtype or device
        (``model.to(...)``) is followed, and shadows kept next to their live shard move along."""
        misshaped = [
            f"{info.name}: {info.local_numel} -> {new.numel()} elements"
            for info, new in zip(self.infos, live)
            if new.numel() != info.local_numel
        ]  # (against what was recorded: ``param.data = other`` changes the very object cached)
        if misshaped:
            emptied = all(
                new.numel() == 0 for info, new in zip(self.infos, live) if info.kind == "param" and info.local_numel
            )
            hint = (
                "; its parameters were emptied, as deepspeed.initialize (ZeRO-3) or accelerator.prepare do when "
                "they partition a model: build the averager on the model they return"
                if emptied
                else ""
            )
            raise ModelChangedError(
                f"the model's local shards changed size after the averager was built: {misshaped[:8]}{hint}"
            )
        if self.options.device is None:
            moved: dict[int, torch.Tensor] = {}  # a shadow shared by several averages moves once
            for average in self.averages.values():
                for index, shadow in enumerate(average.shadows):
                    if shadow is not None and shadow.device != live[index].device:
                        if id(shadow) not in moved:
                            moved[id(shadow)] = shadow.to(live[index].device)
                        average.shadows[index] = moved[id(shadow)]
        self.live = live
        self.groups = self._group()

    def verify_structure(self) -> None:
        """Rescan the model; raise ``ModelChangedError`` naming what differs from construction time."""
        infos = self.strategy.tensors()

        def key(info: TensorInfo) -> tuple:
            return (info.aliases, info.kind, tuple(info.shape), info.part)

        old = {info.name: info for info in self.infos}
        new = {info.name: info for info in infos}
        missing = [name for name in old if name not in new]
        added = [name for name in new if name not in old]
        changed = [
            f"{name} (shape {tuple(old[name].shape)} -> {tuple(new[name].shape)}, "
            f"held on this rank {old[name].part.shown()} -> {new[name].part.shown()})"
            for name in old
            if name in new and key(old[name]) != key(new[name])
        ]
        if missing or added or changed or list(old) != list(new):
            raise ModelChangedError(
                f"the model's parameters changed after the averager was built: missing {missing}, "
                f"new {added}, changed [{', '.join(changed)}]; build a new WeightAverager for the new model"
            )
        self.infos = infos
        self._module_ids = {id(module) for module in self.strategy.model.modules()}
        self._structure_dirty = False
        self._follow(self.strategy.local_views())

    def sync_live(self) -> None:
        """Cheap per-update check that the cached local views are still the engine's, as grouped."""
        if self._structure_dirty:
            self.verify_structure()
        else:
            self._follow(self.strategy.local_views())

    def _follow(self, live: list[torch.Tensor]) -> None:
        """Regroup only when a view is a new object or changed dtype or device."""
        if not all(map(operator.is_, live, self.live)) or not groups_current(self.groups):
            self._rebind(live)

    # ------------------------------------------------------------------ the check on an accelerator

    def check_on_device(self) -> bool:
        """Whether the non-finite check runs on the device, read by the host later: with the check
        on, built-in rules only, and every live shard on one accelerator (a host read there waits
        for every kernel queued before it)."""
        if self.options.on_nonfinite == "off" or self.num_updates == 0:  # the first update is checked on the host
            return False
        if not all(isinstance(average.rule, LerpRule) for average in self.averages.values()):
            return False
        if self.deferred is not None:
            return self.deferred
        devices = {group.lives[0].device for group in self.groups}
        return len(devices) == 1 and next(iter(devices)).type != "cpu"

    def weight(self, name: str | None, counter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Average ``name``'s lerp weight after ``counter`` updates (a device tensor), looked up on
        the device in a table the host extends before the count can outgrow it."""
        key = (name, counter.device, dtype)
        table = self.weight_tables.get(key)
        needed = self.num_updates + len(self.pending) + 1
        if table is None or table.numel() <= needed:
            rule = self.averages[name].rule
            weights = [1.0] + [rule.weight(n) for n in range(1, 2 * needed + 64)]  # type: ignore[attr-defined]
            table = self.weight_tables[key] = torch.tensor(weights, dtype=dtype, device=counter.device)
        return table.index_select(0, counter.view(1))

    def settle(self, block: bool = True) -> None:
        """Read the verdicts of updates checked on the device, in order: count each one applied,
        or (non-finite live values: the device left the average untouched) raise or warn as the
        ``on_nonfinite`` policy says. Without ``block`` only verdicts already on the host are read."""
        while self.pending:
            step, verdicts = self.pending[0]
            if any(v.event is None or not v.event.query() for v in verdicts) and not block:
                return
            for verdict in verdicts:
                if verdict.event is not None:
                    verdict.event.synchronize()
            self.pending.popleft()
            bad = [self.infos[i].name for v in verdicts for i, flag in zip(v.indices, v.bad.tolist()) if flag]
            if not bad:
                self.num_updates += 1
                continue
            self.nonfinite_found(
                bad,
                step,
                raised="non-finite live values in {bad} {where} (found on the device after the update was issued: "
                "that update was masked out there, the average holds the others; on_nonfinite='skip' warns instead)",
                warned="skipped the update {where}: non-finite live values in {bad}",
            )

    def nonfinite_found(self, bad: list[str], step: int, raised: str, warned: str) -> None:
        """The ``on_nonfinite`` policy for an update whose live shards ``bad`` were not finite:
        raise ``raised``, or warn ``warned`` and count the update skipped."""
        where = f"at step {step} on rank {rank()}"
        if self.options.on_nonfinite == "raise":
            raise NonFiniteError(raised.format(bad=bad, where=where))
        warnings.warn(warned.format(bad=bad, where=where), RuntimeWarning, stacklevel=4)
        self.num_skipped += 1

    # ------------------------------------------------------------------ reading

    def piece(self, index: int, average: str | None = None) -> torch.Tensor:
        """This rank's part of tensor ``index`` in ``average``, flat: its shadow, or the live value
        for tensors not stored (``average`` may be ``None`` for copied and live tensors)."""
        if not self.stored(index):
            return self.live[index].detach().reshape(-1)
        average = self.names[0] if self.roles[index] == "copy" else average
        return self.average(average).shadows[index].detach().reshape(-1)  # type: ignore[union-attr]

    def require_updates(self, what: str) -> None:
        self.settle()
        if self.num_updates == 0:
            raise RuntimeError(
                f"{what} needs averaged weights, but no update has been applied yet "
                f"(the first update() at a step >= start_step={self.options.start_step} copies the live weights)"
            )

    def check_ranks_agree(self) -> None:
        """Collective: every rank applied the same updates, so the shards form one average."""
        self.settle()
        if not distributed():
            return
        counts: list = [None] * dist.get_world_size()
        dist.all_gather_object(counts, (self.num_updates, self.num_skipped))
        if len(set(counts)) > 1:
            raise RuntimeError(
                "ranks disagree on the number of updates applied (num_updates, num_skipped): "
                + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
                + "; a rank skipped an update for non-finite values, so the shards do not form one average"
            )

    def check_current(self) -> None:
        """Collective: the model is still the one the state was built on, and the ranks agree."""
        self.verify_structure()
        self.check_ranks_agree()

    def gathered(self, dst: int | None, average: str | None) -> Iterator[tuple[TensorInfo, torch.Tensor | None]]:
        """Collective: check the state now, then gather the full tensors of ``average`` as the
        iterator is consumed.

        With ``dst`` set only that rank receives (others get ``None``); with ``None`` every rank
        receives the owners' values (replicas such as per-rank BatchNorm statistics included).
        """
        name = self.average(average).name
        self.require_updates("gathering the average")
        self.check_current()
        gathered = iter_gathered(
            self.layout,
            self.infos,
            lambda index: self.piece(index, name),
            range(len(self.infos)),
            dst=dst,
            bucket_bytes=self.gather_bucket_bytes,
        )

        def named() -> Iterator[tuple[TensorInfo, torch.Tensor | None]]:
            for index, full in gathered:
                yield self.infos[index], full
                del full  # hold nothing while the next bucket is gathered

        return named()

    def shadow_bytes(self) -> int:
        storages = {
            s.untyped_storage().data_ptr(): s.untyped_storage().nbytes()
            for average in self.averages.values()
            for s in average.shadows
            if s is not None
        }
        return sum(storages.values())

    # ------------------------------------------------------------------ description

    def describe(self) -> dict[str, Any]:
        """Everything but the tensors' values, as JSON-able data."""
        self.settle()
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "num_updates": self.num_updates,
            "num_skipped": self.num_skipped,
            "averages": [{"name": a.name, "rule": a.rule.to_config()} for a in self.averages.values()],
            "strategy": self.strategy.name,
            "world_size": world_size(),
            "options": self.options.describe(),
            **({} if self.run_id is None else {"run": self.run_id}),
            "tensors": [
                {
                    "name": info.name,
                    "aliases": list(info.aliases),
                    "kind": info.kind,
                    "role": role,
                    "shape": list(info.shape),
                    "dtype": dtype_name(self.piece(index, self.names[0]).dtype),
                }
                for index, (info, role) in enumerate(zip(self.infos, self.roles))
            ],
        }

    def reseed(self, step: int) -> None:
        """Restart every average from the live weights, as if its first update at ``step`` had copied them."""
        with torch.no_grad():
            for index, live in enumerate(self.live):
                for _, average in self.keys(index):
                    if self.stored(index):
                        self.piece(index, average).copy_(live.reshape(-1))
        self.step, self.num_updates, self.num_skipped = step, 1, 0
        self.device_counters.clear()
        self.pending.clear()

    def restore(self, description: dict[str, Any], saved: set[str]) -> None:
        """Take a description's counters once the shadows whose keys are in ``saved`` hold its
        values; other shadows (a non-strict load) restart from the live weights."""
        with torch.no_grad():
            for index, live in enumerate(self.live):
                for key, average in self.keys(index):
                    if self.stored(index) and key not in saved:
                        self.piece(index, average).copy_(live.reshape(-1))
        self.step = int(description["step"])
        self.num_updates = int(description["num_updates"])
        self.num_skipped = int(description.get("num_skipped", 0))
        self.run_id = description.get("run")
        self.device_counters.clear()
        self.pending.clear()  # verdicts on updates the restored state replaces
