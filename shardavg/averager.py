"""``WeightAverager``: an average of a model's weights kept next to the shards each rank owns.

The flow is engine -> strategy adapter -> averager: the adapter says which tensors exist and
where this rank's shard of each is (its *local view*); the averager keeps a shadow of every
local view and updates it in place with a few fused ``torch._foreach_*`` calls, with no
communication. Full tensors are gathered only on request (``full_state_dict``, ``copy_to``),
one bounded bucket at a time.
"""

from __future__ import annotations

import contextlib
import operator
import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint, stateful
from ._logging import log
from .errors import ModelChangedError, NonFiniteError
from .export import export as export_model
from .layout import DEFAULT_BUCKET_BYTES, ShardLayout, distributed, iter_gathered, rank
from .rules import EMA, LerpRule, MultiAvgFn, Rule, as_rule
from .strategies import make_strategy
from .strategies.base import TensorInfo
from .update import Role, UpdateGroup, apply_custom, copy_live, group_tensors, groups_current, lerp, nonfinite

BUFFER_POLICIES = ("copy", "average", "ignore")
NONFINITE_POLICIES = ("raise", "skip")
DEFAULT_RULE = EMA(decay=0.999)

# Parameter, buffer and submodule registrations on a watched model mark its averagers for a
# full structure check at their next update (replacing `model.fc` or `model.fc.weight`).
_WATCHED: weakref.WeakSet[WeightAverager] = weakref.WeakSet()
_hooks_installed = False


def _on_registration(module: nn.Module, name: str, value: object) -> None:
    for averager in list(_WATCHED):
        if id(module) in averager._module_ids:
            averager._structure_dirty = True


def _watch(averager: WeightAverager) -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.nn.modules import module as module_hooks

        module_hooks.register_module_parameter_registration_hook(_on_registration)
        module_hooks.register_module_buffer_registration_hook(_on_registration)
        module_hooks.register_module_module_registration_hook(_on_registration)
        _hooks_installed = True
    _WATCHED.add(averager)


class WeightAverager:
    """Keeps an average (EMA, SWA, power EMA, any rule) of a model's weights, shard by shard.

    Args:
        model: a ``DeepSpeedEngine``, an FSDP1 module, a ``fully_shard``-ed module, a DDP
            module or a plain ``nn.Module``. Building the averager is a collective.
        rule: ``EMA(...)``, ``SWA()``, ``PowerEMA(...)`` or a ``multi_avg_fn(shadow_list,
            live_list, num_updates)`` callable such as ``get_ema_multi_avg_fn(0.999)``.
        strategy: ``"auto"`` (detect) or one of ``"replicated"``, ``"fsdp1"``, ``"fsdp2"``,
            ``"zero3"``; a forced strategy that does not fit the model is refused.
        every_n_steps, start_step: update at steps ``start_step, start_step + n, ...``.
        dtype: shadow dtype of floating tensors (fp32 default, so bf16/fp16 weights are
            averaged without rounding each update); ``None`` keeps the live dtype.
        buffers: ``"copy"`` (the live value at each update), ``"average"`` (floating buffers
            averaged, integer ones copied) or ``"ignore"`` (exports carry the live value).
        device: where shadows live; ``None`` next to each live shard, ``"cpu"`` offloaded.
        include_frozen: also average parameters with ``requires_grad=False`` (otherwise they
            are exported with their live values).
        on_nonfinite: ``"raise"`` (default) or ``"skip"`` (warn and leave the average
            untouched) when a live weight holds NaN or infinity.

    ``gather_bucket_bytes`` bounds what a gather (``full_state_dict``, ``copy_to``,
    ``export``) holds at once on a receiving rank, beyond the largest single tensor.
    """

    gather_bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __init__(
        self,
        model: nn.Module,
        rule: Rule | MultiAvgFn = DEFAULT_RULE,
        *,
        strategy: str = "auto",
        every_n_steps: int = 1,
        start_step: int = 0,
        dtype: torch.dtype | None = torch.float32,
        buffers: str = "copy",
        device: torch.device | str | None = None,
        include_frozen: bool = False,
        on_nonfinite: str = "raise",
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        if buffers not in BUFFER_POLICIES:
            raise ValueError(f"unknown buffers policy {buffers!r}; expected one of {BUFFER_POLICIES}")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"unknown on_nonfinite policy {on_nonfinite!r}; expected one of {NONFINITE_POLICIES}")
        self.rule = as_rule(rule)
        self.strategy = make_strategy(model, strategy)
        self.every_n_steps = every_n_steps
        self.start_step = start_step
        self.dtype = dtype
        self.buffers = buffers
        self.device = None if device is None else torch.device(device)
        self.include_frozen = include_frozen
        self.on_nonfinite = on_nonfinite

        self.step = 0  # last step seen by update()
        self.num_updates = 0  # updates applied (the first one copies)
        self.num_skipped = 0  # updates skipped for non-finite live weights
        self._counters: dict[torch.device, torch.Tensor] = {}  # num_updates on each device, for custom rules
        self._swapped = False
        self._meshes: dict[str, Any] = {}  # device type -> DeviceMesh over all ranks, for state_dict()

        self._infos = self.strategy.tensors()
        self._live = self.strategy.local_views()
        self._roles = [self._role(info) for info in self._infos]
        self.layout = ShardLayout.build(self._infos)
        self._shadows = [self._allocate(index) for index in range(len(self._infos))]
        narrowed = [
            i.name
            for i, s, v in zip(self._infos, self._shadows, self._live)
            if s is not None and s.dtype.itemsize < v.dtype.itemsize
        ]
        if narrowed:
            warnings.warn(f"{len(narrowed)} shadows are {self.dtype}, below their live dtype: {narrowed}", stacklevel=2)
        self._groups = group_tensors(self._roles, self._shadows, self._live)
        self._module_ids = {id(module) for module in self.strategy.model.modules()}
        self._structure_dirty = False
        _watch(self)
        log.info(
            "shardavg: %s strategy, %d tensors (%d averaged), %.1f MiB of shadows on rank 0",
            self.strategy.name,
            len(self._infos),
            self._roles.count("average"),
            self.shadow_bytes() / 2**20,
        )

    # ------------------------------------------------------------------ set-up

    def _role(self, info: TensorInfo) -> Role:
        if info.kind == "param":
            return "average" if info.requires_grad or self.include_frozen else "live"
        if self.buffers == "ignore":
            return "live"
        if self.buffers == "average" and info.dtype.is_floating_point:
            return "average"
        return "copy"

    def _allocate(self, index: int) -> torch.Tensor | None:
        role, live = self._roles[index], self._live[index]
        if role == "live":
            return None
        dtype = live.dtype
        if role == "average" and live.dtype.is_floating_point and self.dtype is not None:
            dtype = self.dtype
        device = self.device or live.device
        pin = device.type == "cpu" and live.device.type == "cuda"
        return torch.empty(live.shape, dtype=dtype, device=device, pin_memory=pin)

    # ------------------------------------------------------------------ live views

    def _rebind(self, live: list[torch.Tensor]) -> None:
        """Adopt the engine's current local views: shapes must not change; a new dtype or device
        (``model.to(...)``) is followed, and shadows kept next to their live shard move along."""
        misshaped = [
            f"{info.name}: {tuple(old.shape)} -> {tuple(new.shape)}"
            for info, old, new in zip(self._infos, self._live, live)
            if new.shape != old.shape
        ]
        if misshaped:
            raise ModelChangedError(f"the model's local shards changed shape after the averager was built: {misshaped}")
        if self.device is None:
            for index, shadow in enumerate(self._shadows):
                if shadow is not None and shadow.device != live[index].device:
                    self._shadows[index] = shadow.to(live[index].device)
        self._live = live
        self._groups = group_tensors(self._roles, self._shadows, self._live)

    def _verify_structure(self) -> None:
        """Rescan the model; raise ``ModelChangedError`` naming what differs from construction time."""
        infos = self.strategy.tensors()

        def key(info: TensorInfo) -> tuple:
            return (info.aliases, info.kind, tuple(info.shape), info.start, info.end)

        old = {info.name: info for info in self._infos}
        new = {info.name: info for info in infos}
        missing = [name for name in old if name not in new]
        added = [name for name in new if name not in old]
        changed = [
            f"{name} (shape {tuple(old[name].shape)} -> {tuple(new[name].shape)}, "
            f"range on this rank [{old[name].start}, {old[name].end}) -> [{new[name].start}, {new[name].end}))"
            for name in old
            if name in new and key(old[name]) != key(new[name])
        ]
        if missing or added or changed or list(old) != list(new):
            raise ModelChangedError(
                f"the model's parameters changed after the averager was built: missing {missing}, "
                f"new {added}, changed [{', '.join(changed)}]; build a new WeightAverager for the new model"
            )
        self._infos = infos
        self._module_ids = {id(module) for module in self.strategy.model.modules()}
        self._structure_dirty = False
        self._rebind(self.strategy.local_views())

    def _sync_live(self) -> None:
        """Cheap per-update check that the cached local views are still the engine's, as grouped."""
        if self._structure_dirty:
            self._verify_structure()
            return
        live = self.strategy.local_views()
        if not all(map(operator.is_, live, self._live)) or not groups_current(self._groups):
            self._rebind(live)

    # ------------------------------------------------------------------ update

    def update(self, step: int | None = None) -> bool:
        """Average the live shards in; call after ``optimizer.step()``. No communication.

        ``step`` is the number of optimizer steps taken; by default one more than the last
        step seen (1 on the first call). The update runs only at ``start_step + k *
        every_n_steps``; the first one copies. Returns whether an update was applied.
        """
        self.step = self.step + 1 if step is None else int(step)
        if self.step < self.start_step or (self.step - self.start_step) % self.every_n_steps:
            return False
        if self._swapped:
            raise RuntimeError("update() inside swapped(): the live model holds averaged weights")
        with torch.no_grad():
            self._sync_live()
            if self._skip_nonfinite():
                return False
            self._apply()
            for counter in self._counters.values():
                counter.add_(1)
        self.num_updates += 1
        return True

    def _apply(self) -> None:
        for group in self._groups:
            if self.num_updates == 0 or group.role == "copy":
                copy_live(group)
            elif isinstance(self.rule, LerpRule):
                lerp(group, self.rule.weight(self.num_updates))
            else:
                apply_custom(group, self.rule.fn, self._counter(group))  # type: ignore[attr-defined]

    def _counter(self, group: UpdateGroup) -> torch.Tensor:
        """``num_updates`` as a tensor on the group's device, kept there and incremented in place."""
        device = group.shadows[0].device
        if device not in self._counters:
            self._counters[device] = torch.tensor(self.num_updates, device=device)
        return self._counters[device]

    def _skip_nonfinite(self) -> bool:
        """Check every live shard the update reads; raise, or warn and return True to skip."""
        bad = [self._infos[index].name for index in nonfinite(self._groups)]
        if not bad:
            return False
        where = f"at step {self.step} on rank {rank()}"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(
                f"non-finite live values in {bad} {where}; the average was not updated "
                "(on_nonfinite='skip' skips such updates instead)"
            )
        warnings.warn(f"skipping the update {where}: non-finite live values in {bad}", RuntimeWarning, stacklevel=3)
        self.num_skipped += 1
        return True

    # ------------------------------------------------------------------ using the average

    def _require_updates(self, what: str) -> None:
        if self.num_updates == 0:
            raise RuntimeError(
                f"{what} needs averaged weights, but no update has been applied yet "
                f"(the first update() at a step >= start_step={self.start_step} copies the live weights)"
            )

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block the live model holds the averaged weights; shard-local, no gather.

        The live shards are stashed and restored bit for bit on exit, also when the block
        raises. Under FSDP and ZeRO-3 the forward passes inside gather the averaged shards.
        """
        self._require_updates("swapped()")
        if self._swapped:
            raise RuntimeError("swapped() blocks cannot be nested")
        self._verify_structure()
        indices = [index for index, shadow in enumerate(self._shadows) if shadow is not None]
        with torch.no_grad():
            stash = [self._live[index].clone() for index in indices]
        self._swapped = True
        try:
            with torch.no_grad():
                self.strategy.release_gathered()
                torch._foreach_copy_([self._live[i] for i in indices], [self._shadows[i] for i in indices])
            yield
        finally:
            with torch.no_grad():
                live = self.strategy.local_views()  # the engine may have re-created views inside the block
                torch._foreach_copy_([live[i] for i in indices], stash)
                self.strategy.release_gathered()
            self._swapped = False
            self._rebind(live)

    def _piece(self, index: int) -> torch.Tensor:
        """This rank's part of tensor ``index``, flat: averaged, or live for tensors not stored."""
        source = self._shadows[index] if self._shadows[index] is not None else self._live[index]
        return source.detach().reshape(-1)

    def _check_ranks_agree(self) -> None:
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

    def _gathered(self, dst: int | None) -> Iterator[tuple[TensorInfo, torch.Tensor | None]]:
        """Collective: check the averager now, then gather full tensors as the iterator is consumed."""
        self._require_updates("gathering the average")
        self._verify_structure()
        self._check_ranks_agree()
        indices = list(range(len(self._infos)))
        gathered = iter_gathered(
            self.layout, self._infos, self._piece, indices, dst=dst, bucket_bytes=self.gather_bucket_bytes
        )

        def named() -> Iterator[tuple[TensorInfo, torch.Tensor | None]]:
            for index, full in gathered:
                yield self._infos[index], full
                del full  # hold nothing while the next bucket is gathered

        return named()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: rank 0 gets ``{name: full tensor}`` on CPU, every name of the plain model; others ``{}``.

        Averaged parameters come in the shadow dtype; frozen parameters and ignored buffers
        carry their live values. Gathered one bounded bucket at a time.
        """
        state: dict[str, torch.Tensor] = {}
        for info, full in self._gathered(dst=0):
            if full is not None:
                full = full.cpu()
                for name in info.names:
                    state[name] = full
        return state

    def copy_to(self, module: nn.Module) -> None:
        """Collective: write the averaged weights into ``module`` (a plain, unsharded model) on every rank."""
        target = module.state_dict(keep_vars=True)
        expected = {name: info.shape for info in self._infos for name in info.names}
        missing = sorted(set(expected) - set(target))
        unexpected = sorted(set(target) - set(expected))
        misshaped = sorted(
            f"{name}: {tuple(target[name].shape)} vs {tuple(shape)}"
            for name, shape in expected.items()
            if name in target and target[name].shape != shape
        )
        if missing or unexpected or misshaped:
            raise ValueError(
                f"copy_to(): {type(module).__name__} does not match the averaged model: missing {missing}, "
                f"unexpected {unexpected}, mis-shaped {misshaped}"
            )
        with torch.no_grad():
            for info, full in self._gathered(dst=None):
                for name in info.names:
                    target[name].copy_(full)

    # ------------------------------------------------------------------ checkpoints and export

    def state_dict(self) -> dict[str, Any]:
        """DCP Stateful: put the averager in ``dcp.save({..., "ema": avg})``; collective there.

        Every tensor is the flattened global tensor of which this rank holds its range (a
        DTensor over ``LocalShardsWrapper``), so ``dcp.load`` reshards to any world size or
        strategy; ``meta`` is a JSON description (counters, rule, names, shapes).
        """
        return stateful.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore from ``state_dict()`` as filled by ``dcp.load``.

        Names and shapes must match (missing, unexpected and mis-shaped tensors are listed);
        a different rule raises unless ``strict=False``, which warns. The tensors are read by
        DCP before this check, straight into the shadows.
        """
        stateful.load_state_dict(self, state_dict, strict)

    def save(self, directory: str | os.PathLike, keep_last: int | None = None) -> Path:
        """Collective: an atomic sharded checkpoint of the averager alone (safetensors + JSON).

        With ``keep_last=K``, saves to ``directory/step-NNNNNNNNN`` and keeps the K newest.
        """
        return checkpoint.save(self, directory, keep_last)

    def load(self, directory: str | os.PathLike, strict: bool = True) -> Path:
        """Collective: restore from ``save``'s checkpoint (or the newest in a ``keep_last`` directory),
        at any world size and strategy. Returns the checkpoint loaded."""
        return checkpoint.load(self, directory, strict)

    def export(
        self, path: str | os.PathLike, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None
    ) -> Path:
        """Collective: write the full average to the directory ``path`` as safetensors (rank 0 writes).

        Gathered a bounded bucket at a time; above ``max_shard_size`` it is split into
        ``model-0000k-of-0000N.safetensors`` files with ``model.safetensors.index.json``.
        ``dtype`` casts floating tensors (e.g. ``torch.bfloat16`` for deployment).
        """
        return export_model(self, path, max_shard_size, dtype)

    def shadow_bytes(self) -> int:
        """Bytes of shadow storage on this rank."""
        storages = {
            s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in self._shadows if s is not None
        }
        return sum(storages.values())

    def __repr__(self) -> str:
        return (
            f"WeightAverager(rule={self.rule!r}, strategy={self.strategy.name!r}, tensors={len(self._infos)}, "
            f"num_updates={self.num_updates}, step={self.step})"
        )
