"""``AverageState``: the averager's tensors and counters, and the one interface the I/O modules use.

``WeightAverager`` (``weight_averager.py``) builds an ``AverageState`` and drives it (``update``,
``swapped``); checkpoints (``checkpoint.py``), DCP (``stateful.py``) and export (``export.py``),
all in ``averager/``, read and restore it through the attributes and methods documented here, and
nothing else:

- ``infos``, ``roles``, ``layout``: what each tensor is, whether it is averaged, copied or not
  stored, and which rank holds which part of it;
- ``averages``: the averages kept, by name (``None`` for an averager built with one rule), each
  with its rule and its shadows on this rank (copied tensors share one shadow across averages);
- ``stored(i)``, ``keys(i)`` and ``flat_part(i, name)``: whether tensor ``i`` has shadows, the keys
  its values are saved under, and this rank's part of it as saved or exported;
- ``check_current()`` before collective I/O, ``gathered(dst)`` for full tensors;
- ``describe()`` and ``resume(description, saved)`` for everything but the tensors' values.

It also keeps the local shards it was built on current (``current_views``, ``adopt``), checking
that the model's structure did not change; its ``updater`` (``update/updater.py``) does the update.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..base.dist import all_gathered, same_everywhere, world_size
from ..base.dtypes import dtype_name
from ..base.errors import ModelChangedError
from ..checkpoints.description import DescribedAverage, Description, TensorEntry, tensor_key
from ..layouts.shard_layout import DEFAULT_BUCKET_BYTES, ShardLayout, Wanted, gather_rounds, iter_gathered
from ..layouts.tensor_info import TensorInfo
from ..rules import Rule
from ..strategies import Strategy
from ..update.fused import gatherable
from ..update.options import Options, Role
from ..update.updater import Updater
from ..update.watch import StructureWatch


@dataclass
class Average:
    """One average: its rule and its shadow of every local shard (``None`` where not stored)."""

    name: str | None
    rule: Rule
    shadows: list[torch.Tensor | None]


class AverageState:
    """Shadows of this rank's local shards (one set per average), the views themselves, the layout
    of every tensor across ranks, and the counters, which all averages share; ``updater`` updates
    them. Building it is a collective."""

    def __init__(self, strategy: Strategy, rules: dict[str | None, Rule], options: Options) -> None:
        self.strategy = strategy
        self.options = options
        self.step = 0  # last step seen by update()
        self.num_updates = 0  # updates applied (the first one copies); counted by the updater alone
        self.num_skipped = 0  # updates skipped for non-finite live weights or the loop's false verdict
        self.run_id: str | None = None  # which run wrote a checkpoint, when the user says (PostHocEMA does)
        self.gather_bucket_bytes = DEFAULT_BUCKET_BYTES
        self.swapped = False  # whether the live model holds an average now (``swap.py``)

        self.infos: list[TensorInfo] = strategy.tensors()
        self.live: list[torch.Tensor] = strategy.local_shards()
        self.roles: list[Role] = options.roles(self.infos)  # (refuses a pattern that matches no tensor)
        self.layout = ShardLayout.build(self.infos)
        self.averages: dict[str | None, Average] = {
            name: Average(name, rule, shadows)
            for (name, rule), shadows in zip(rules.items(), self._allocate(len(rules)))
        }
        self.watch = StructureWatch(strategy.model.modules())
        self.updater = Updater(self)

    def _allocate(self, count: int) -> list[list[torch.Tensor | None]]:
        """``count`` sets of shadows carved from one zeroed pool per (device, dtype): the copied
        tensors once, shared by every set, then each set's averaged ones in order, so that shadows
        of neighbouring local shards are neighbours too and the update fuses them (small shards that
        lie apart first, back to back, so the update can gather them)."""
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
        pools = {
            kind: torch.zeros(size, dtype=kind[0], device=kind[1], pin_memory=kind[2]) for kind, size in sizes.items()
        }
        offsets = dict.fromkeys(pools, 0)

        small = gatherable(self.live)  # carved first, back to back: the update gathers them (``fused.py``)
        order = small + sorted(set(range(len(self.live))) - set(small))

        def carve(role: Role) -> list[torch.Tensor | None]:
            shadows: list[torch.Tensor | None] = [None] * len(self.live)
            for index in order:
                kind, live = kinds[index], self.live[index]
                if kind is not None and self.roles[index] == role:
                    start, offsets[kind] = offsets[kind], offsets[kind] + live.numel()
                    shadows[index] = pools[kind][start : offsets[kind]].view(live.shape)
            return shadows

        copied = carve("copy")
        sets = [carve("average") for _ in range(count)]
        return [[c if a is None else a for a, c in zip(averaged, copied)] for averaged in sets]

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

    def current_views(self) -> list[torch.Tensor]:
        """The engine's local shards now, the model rescanned first if a parameter, buffer or
        submodule was replaced since (``verify_structure``). Cheap when nothing changed."""
        if self.watch.changed:
            self.verify_structure()
        return self.strategy.local_shards()

    def adopt(self, live: list[torch.Tensor]) -> None:
        """Take the engine's current local shards: sizes must not change; a new dtype or device
        (``model.to(...)``) is followed, and shadows kept next to their local shard move along."""
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

    def verify_structure(self) -> None:
        """Rescan the model; raise ``ModelChangedError`` naming what differs from construction time;
        then follow the engine's views (regrouping the update if they changed)."""
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
        self.watch.reset(self.strategy.model.modules())
        self.updater.guard_forwards()  # (a module that writes its weights in its forward may be new)
        self.updater.follow(self.strategy.local_shards())

    # ------------------------------------------------------------------ reading

    def flat_part(self, index: int, average: str | None = None, live: bool = False) -> torch.Tensor:
        """This rank's part of tensor ``index`` in ``average``, flat: its shadow, or the live value
        for tensors not stored (``average`` may be ``None`` for copied and live tensors); with
        ``live``, the live value of every tensor."""
        if live or not self.stored(index):
            return self.live[index].detach().reshape(-1)
        average = self.names[0] if self.roles[index] == "copy" else average
        return self.average(average).shadows[index].detach().reshape(-1)  # type: ignore[union-attr]

    def require_updates(self, what: str) -> None:
        """Before the average is read: it holds updates, and none read weights being written (``torn``)."""
        self.updater.require_whole(what)
        self.updater.settle()
        if self.num_updates == 0:
            raise RuntimeError(
                f"{what} needs averaged weights, but no update has been applied yet "
                f"(the first update() at a step >= start_step={self.options.start_step} copies the live weights)"
            )

    def check_ranks_agree(self) -> None:
        """Collective: every rank applied the same updates, so the shards form one average."""
        self.updater.settle()
        if same_everywhere([self.num_updates, self.num_skipped]):
            return
        counts = all_gathered((self.num_updates, self.num_skipped))
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

    def gathered(
        self, dst: int | None, average: str | None, live: bool = False
    ) -> Iterator[tuple[TensorInfo, torch.Tensor | None]]:
        """Collective: check the state now, then gather the full tensors of ``average`` (with
        ``live``, of the live weights) as the iterator is consumed.

        With ``dst`` set only that rank receives (others get ``None``); with ``None`` every rank
        receives the owners' values (replicas such as per-rank BatchNorm statistics included).
        """
        name = self._check_gathering(average, live)
        gathered = iter_gathered(
            self.layout,
            self.infos,
            lambda index: self.flat_part(index, name, live),
            range(len(self.infos)),
            dst=dst,
            bucket_bytes=self.gather_bucket_bytes,
        )

        def named() -> Iterator[tuple[TensorInfo, torch.Tensor | None]]:
            for index, full in gathered:
                yield self.infos[index], full
                del full  # hold nothing while the next bucket is gathered

        return named()

    def gathered_to(
        self, rounds: Iterable[Sequence[Wanted]], average: str | None, live: bool = False
    ) -> Iterator[tuple[int, int | None, torch.Tensor | None]]:
        """Collective: check the state now, then gather each ``(index, dst, rows)`` of ``rounds`` to
        its rank as the iterator is consumed (``layout.gather_rounds``)."""
        name = self._check_gathering(average, live)
        return gather_rounds(self.layout, self.infos, lambda index: self.flat_part(index, name, live), rounds)

    def _check_gathering(self, average: str | None, live: bool) -> str | None:
        """Collective: the average's name (None for the live weights), once the state can be gathered."""
        name = None if live else self.average(average).name
        if not live:
            self.require_updates("gathering the average")
        self.check_current()
        return name

    def narrowed(self) -> list[str]:
        """Tensors whose shadows are of a narrower dtype than their local shards (worth a warning)."""
        return [
            info.name
            for info, shadow, live in zip(self.infos, self.average(self.names[0]).shadows, self.live)
            if shadow is not None and shadow.dtype.itemsize < live.dtype.itemsize
        ]

    def summary(self) -> str:
        """What was built, in one line: the engine, the tensors, what the shadows cost."""
        named = "" if self.names == [None] else f" into {', '.join(map(str, self.names))}"
        gathered = len(self.layout.gathered)
        listed = f"; the layouts of {gathered} gathered from every rank (not derivable)" if gathered else ""
        return (
            f"{self.strategy.name} strategy, {len(self.infos)} tensors ({self.roles.count('average')} "
            f"averaged{named}), {self.shadow_bytes() / 2**20:.1f} MiB of shadows on rank 0{listed}"
        )

    def combine(self, terms: Iterable[tuple[list[torch.Tensor | None], float]], step: int, num_updates: int) -> None:
        """The only average set to the sum of ``weight`` times each term's shadows, its copied
        tensors to the last term's, its counts to ``step`` and ``num_updates`` (post-hoc synthesis)."""
        shadows = self.average(None).shadows
        averaged = [i for i, shadow in enumerate(shadows) if shadow is not None and self.roles[i] == "average"]
        copied = [i for i, shadow in enumerate(shadows) if shadow is not None and self.roles[i] == "copy"]
        last = None
        with torch.no_grad():
            torch._foreach_zero_([shadows[i] for i in averaged])
            for source, weight in terms:
                if averaged:
                    torch._foreach_add_([shadows[i] for i in averaged], [source[i] for i in averaged], alpha=weight)
                last = source
            for i in copied if last is not None else ():
                shadows[i].copy_(last[i])
        self.step, self.num_updates, self.num_skipped = step, num_updates, 0
        self.updater.forget()

    def shadow_bytes(self) -> int:
        storages = {
            s.untyped_storage().data_ptr(): s.untyped_storage().nbytes()
            for average in self.averages.values()
            for s in average.shadows
            if s is not None
        }
        return sum(storages.values())

    # ------------------------------------------------------------------ description

    def describe(self, stored_dtype: torch.dtype | None = None) -> Description:
        """Everything but the tensors' values; the averaged tensors' dtype ``stored_dtype`` where
        a save casts them (else their shadows')."""
        self.updater.settle()
        return Description(
            step=self.step,
            num_updates=self.num_updates,
            num_skipped=self.num_skipped,
            averages=tuple(DescribedAverage(a.name, a.rule.to_json()) for a in self.averages.values()),
            tensors=tuple(
                TensorEntry(
                    info.name,
                    tuple(info.aliases),
                    info.kind,
                    role,
                    tuple(info.shape),
                    dtype_name(
                        stored_dtype
                        if stored_dtype is not None and role == "average"
                        else self.flat_part(index, self.names[0]).dtype
                    ),
                )
                for index, (info, role) in enumerate(zip(self.infos, self.roles))
            ),
            strategy=self.strategy.name,
            world_size=world_size(),
            options=self.options,
            run=self.run_id,
        )

    def restart(self, step: int) -> None:
        """Restart every average from the live weights, as if its first update at ``step`` had copied them."""
        with torch.no_grad():
            for index, live in enumerate(self.live):
                for _, average in self.keys(index):
                    if self.stored(index):
                        self.flat_part(index, average).copy_(live.reshape(-1))
        self.step, self.num_updates, self.num_skipped = step, 1, 0
        self.updater.forget()

    def resume(self, description: Description, saved: set[str]) -> None:
        """Take a description's counters once the shadows whose keys are in ``saved`` hold its
        values; other shadows (a non-strict load) restart from the live weights."""
        with torch.no_grad():
            for index, live in enumerate(self.live):
                for key, average in self.keys(index):
                    if self.stored(index) and key not in saved:
                        self.flat_part(index, average).copy_(live.reshape(-1))
        self.step, self.num_updates = description.step, description.num_updates
        self.num_skipped, self.run_id = description.num_skipped, description.run
        self.updater.forget()  # verdicts on updates the restored state replaces
