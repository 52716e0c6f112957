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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint, stateful
from ._logging import built_by_user, log
from .description import RUN_ID
from .export import export as export_model
from .rules import EMA, LerpRule, MultiAvgFn, Rule, as_rule
from .state import AVERAGE_NAME, MAX_PENDING, AverageState, Options
from .strategies import make_strategy
from .update import Step, UpdateGroup, apply, apply_masked, nonfinite, screen_on_device

BUFFER_POLICIES = ("copy", "average", "ignore")
NONFINITE_POLICIES = ("raise", "skip", "off")
DEFAULT_RULE = EMA(decay=0.999)


class WeightAverager:
    """Keeps an average (EMA, SWA, power EMA, any rule) of a model's weights, shard by shard.

    Args:
        model: a ``DeepSpeedEngine``, an FSDP1 module, a module with DTensor parameters
            (``fully_shard``, tensor or expert parallel, any mix), a DDP module or a plain
            ``nn.Module``. Building the averager is a collective.
        rule: ``EMA(...)``, ``SWA()``, ``PowerEMA(...)`` or a ``multi_avg_fn(shadow_list,
            live_list, num_updates)`` callable such as ``get_ema_multi_avg_fn(0.999)``; or a dict
            of them, ``{"ema": EMA(decay=0.999), "swa": SWA()}``, to keep several named averages
            that share one read of the live shards per update (methods that use one average
            then take its name, ``swapped("swa")``).
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
            untouched) when a live weight holds NaN or infinity; ``"off"`` skips the check
            (one read of every live shard less per update) and averages whatever is there.
        source: ``"live"`` (default) averages the weights the model holds; ``"master"``, for a
            DeepSpeed engine in bf16/fp16 (ZeRO-1, 2 or 3), this rank's part of the optimizer's
            fp32 masters (frozen parameters, which have none, are read live). ``swapped()``
            writes the live weights either way.
        pipeline: for pipeline parallel, the process group (or mesh) of this rank's pipeline, as
            ``PipelineStage`` gets it; ``model`` is then this rank's stage module (a copy of the
            full model with the other stages' layers deleted, so it keeps the full model's
            names), or a list of its stages. The averager covers the whole model: gathers,
            exports and checkpoints hold every stage's tensors; ``update()`` and ``swapped()``
            touch this rank's own.

    ``gather_bucket_bytes`` bounds what a gather (``full_state_dict``, ``copy_to``,
    ``export``) holds at once on a receiving rank, beyond the largest single tensor.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        rule: Rule | MultiAvgFn | Mapping[str, Rule | MultiAvgFn] = DEFAULT_RULE,
        *,
        strategy: str = "auto",
        every_n_steps: int = 1,
        start_step: int = 0,
        dtype: torch.dtype | None = torch.float32,
        buffers: str = "copy",
        device: torch.device | str | None = None,
        include_frozen: bool = False,
        on_nonfinite: str = "raise",
        source: str = "live",
        pipeline: Any = None,
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
        options = Options(
            every_n_steps=every_n_steps,
            start_step=start_step,
            dtype=dtype,
            buffers=buffers,
            device=None if device is None else torch.device(device),
            include_frozen=include_frozen,
            on_nonfinite=on_nonfinite,
        )
        rules = _named_rules(rule)
        self._state = AverageState(make_strategy(model, strategy, source, pipeline), rules, options)
        self._swapped = False
        state = self._state
        narrowed = [
            info.name
            for info, shadow, live in zip(state.infos, state.average(state.names[0]).shadows, state.live)
            if shadow is not None and shadow.dtype.itemsize < live.dtype.itemsize
        ]
        if narrowed:
            warnings.warn(f"{len(narrowed)} shadows are {dtype}, below their live dtype: {narrowed}", stacklevel=2)
        if built_by_user():
            self._announce(rules)

    def _announce(self, rules: dict[str | None, Rule]) -> None:
        """One line on what was built: the engine, the tensors and what the shadows cost."""
        state = self._state
        log.info(
            "shardavg: %s strategy, %d tensors (%d averaged%s), %.1f MiB of shadows on rank 0",
            state.strategy.name,
            len(state.infos),
            state.roles.count("average"),
            "" if rules.keys() == {None} else f" into {', '.join(map(str, rules))}",
            state.shadow_bytes() / 2**20,
        )

    # ------------------------------------------------------------------ settings and counters

    @property
    def rule(self) -> Rule:
        """The averaging rule (of the only average; ``rules`` gives every named one's)."""
        return self._state.average(None).rule

    @property
    def rules(self) -> dict[str | None, Rule]:
        """Every average's rule by name (``{None: rule}`` for an averager built with one rule)."""
        return {name: average.rule for name, average in self._state.averages.items()}

    strategy = property(lambda self: self._state.strategy, doc="The engine adapter in use.")
    layout = property(lambda self: self._state.layout, doc="Which rank holds which part of every tensor.")
    every_n_steps = property(lambda self: self._state.options.every_n_steps)
    start_step = property(lambda self: self._state.options.start_step)
    dtype = property(lambda self: self._state.options.dtype)
    buffers = property(lambda self: self._state.options.buffers)
    device = property(lambda self: self._state.options.device)
    include_frozen = property(lambda self: self._state.options.include_frozen)
    on_nonfinite = property(lambda self: self._state.options.on_nonfinite)
    step = property(lambda self: self._state.step, doc="The last step seen by update() (restored by load).")

    @property
    def num_updates(self) -> int:
        """Updates applied (restored by load). Reads the pending verdicts of updates checked on an
        accelerator first, so it waits for them there (and raises or warns for a non-finite one)."""
        self._state.settle()
        return self._state.num_updates

    @property
    def num_skipped(self) -> int:
        """Updates skipped for non-finite live weights (reads pending verdicts, as ``num_updates``)."""
        self._state.settle()
        return self._state.num_skipped

    @property
    def run_id(self) -> str | None:
        """An identity of the run (32 hex digits) written into every checkpoint this averager saves
        and restored by ``load``; None unless set. ``PostHocEMA`` sets it to tell its snapshots
        from those another run left in the same directory."""
        return self._state.run_id

    @run_id.setter
    def run_id(self, value: str | None) -> None:
        if value is not None and not (isinstance(value, str) and RUN_ID.match(value)):
            raise ValueError(f"run_id must be 32 lower-case hex digits or None, got {value!r}")
        self._state.run_id = value

    @property
    def gather_bucket_bytes(self) -> int:
        """What a gather (``full_state_dict``, ``copy_to``, ``export``) holds at once on a receiving
        rank, beyond the largest single tensor (64 MiB by default)."""
        return self._state.gather_bucket_bytes

    @gather_bucket_bytes.setter
    def gather_bucket_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"gather_bucket_bytes must be an int >= 1, got {value!r}")
        self._state.gather_bucket_bytes = value

    # ------------------------------------------------------------------ update

    def update(self, step: int | None = None) -> bool:
        """Average the live shards in; call after ``optimizer.step()``. No communication.

        ``step`` is the number of optimizer steps taken; by default one more than the last
        step seen (1 on the first call). The update runs only at ``start_step + k *
        every_n_steps``; the first one copies. Returns whether an update was applied. A call
        refused (inside ``swapped()``, or a ``step`` not after the last one) changes nothing.
        """
        if self._swapped:
            raise RuntimeError("update() inside swapped(): the live model holds averaged weights")
        state = self._state
        state.step = self._next_step(step)
        options = state.options
        if state.step < options.start_step or (state.step - options.start_step) % options.every_n_steps:
            return False
        with torch.no_grad():
            state.sync_live()
            if state.check_on_device():
                self._apply_on_device()
                return True
            state.settle()  # (nothing pending unless the model just left its accelerator)
            if self._skip_nonfinite():
                return False
            self._apply()
            for counter in state.device_counters.values():
                counter.add_(1)
        state.num_updates += 1
        return True

    def _next_step(self, step: int | None) -> int:
        """The step of this update: steps only go forward, so no step is averaged in twice."""
        state = self._state
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

    def _apply(self) -> None:
        state = self._state
        for group in state.groups:
            if state.num_updates == 0 or group.role == "copy":
                steps: list[Step] = [None] * len(group.shadows)
            else:
                steps = [self._step(average.rule, group) for average in state.averages.values()]
            apply(group, steps, state.stager)

    def _apply_on_device(self) -> None:
        """The update with the non-finite check left on the device (see ``AverageState.check_on_device``):
        screened, masked and counted there, so the host never waits; its verdict is read later."""
        state = self._state
        state.settle(block=len(state.pending) >= MAX_PENDING)
        verdicts, oks = screen_on_device(state.groups)
        (live_device,) = {group.lives[0].device for group in state.groups}
        ok = oks.get(live_device, torch.ones((), dtype=torch.bool, device=live_device))  # no floating shard: ok
        for group in state.groups:
            ok_here = ok.to(group.shadows[0][0].device)  # offloaded shadows: the host waits for the flag
            counter = self._counter(group)
            if group.role == "copy":
                weights: list[torch.Tensor | None] = [None]
            else:
                dtype = group.shadows[0][0].dtype
                weights = [state.weight(name, counter, dtype) for name in state.averages]
            apply_masked(group, ok_here, weights, state.stager)
        for device, counter in state.device_counters.items():
            counter.add_(ok.to(device))
        state.pending.append((state.step, verdicts))
        state.settle(block=False)

    def _step(self, rule: Rule, group: UpdateGroup) -> Step:
        if isinstance(rule, LerpRule):
            return rule.weight(self._state.num_updates)
        return rule.fn, self._counter(group)  # type: ignore[attr-defined]

    def _counter(self, group: UpdateGroup) -> torch.Tensor:
        """``num_updates`` as a tensor on the group's device, kept there and incremented in place."""
        counters, device = self._state.device_counters, group.shadows[0][0].device
        if device not in counters:
            self._state.settle()  # the count must be exact when it moves to the device
            counters[device] = torch.tensor(self._state.num_updates, device=device)
        return counters[device]

    def _skip_nonfinite(self) -> bool:
        """Check every live shard the update reads; raise, or warn and return True to skip."""
        state = self._state
        if state.options.on_nonfinite == "off":
            return False
        bad = [state.infos[index].name for index in nonfinite(state.groups)]
        if not bad:
            return False
        state.nonfinite_found(
            bad,
            state.step,
            raised="non-finite live values in {bad} {where}; the average was not updated "
            "(on_nonfinite='skip' skips such updates instead)",
            warned="skipping the update {where}: non-finite live values in {bad}",
        )
        return True

    # ------------------------------------------------------------------ using the average

    @contextlib.contextmanager
    def swapped(self, average: str | None = None) -> Iterator[None]:
        """Inside the block the live model holds the averaged weights; shard-local, no gather.

        The live shards are stashed and restored bit for bit on exit, also when the block
        raises. Under FSDP and ZeRO-3 the forward passes inside gather the averaged shards.
        ``average`` names which one when the averager keeps several. With ZeRO-1/2 masters
        (``source="master"``) every rank holds the whole live model: the average is gathered
        into it, so there ``swapped()`` is a collective.
        """
        state = self._state
        indices = self._stored_indices(average, "swapped()", "swapped() blocks cannot be nested")
        targets = state.strategy.swap_views()  # the tensors the forward reads
        with torch.no_grad():
            stash = [targets[index].clone() for index in indices]
        self._swapped = True
        try:
            self._write_into(targets, indices, average)
            yield
        finally:
            with torch.no_grad():
                targets = state.strategy.swap_views()  # the engine may have re-created views inside the block
                torch._foreach_copy_([targets[i] for i in indices], stash)
                state.strategy.release_gathered()
            self._swapped = False
            state.sync_live()

    def copy_into_model(self, average: str | None = None) -> None:
        """Write the average into the live model for good (shard-local, as ``swapped()`` does on
        entry): e.g. to go on from the averaged weights, or to save them with the engine's own
        checkpointing. The live weights are lost. Collective where ``swapped()`` is."""
        state = self._state
        indices = self._stored_indices(
            average,
            "copy_into_model()",
            "copy_into_model() inside swapped(): the live model holds averaged weights already",
        )
        self._write_into(state.strategy.swap_views(), indices, average)
        state.sync_live()

    def _stored_indices(self, average: str | None, what: str, nested: str) -> list[int]:
        """Before the average is written into the model: it exists and has updates, no swap is
        active (``nested`` otherwise), the model is the one averaged; the tensors to write."""
        state = self._state
        shadows = state.average(average).shadows
        state.require_updates(what)
        if self._swapped:
            raise RuntimeError(nested)
        state.verify_structure()
        return [index for index, shadow in enumerate(shadows) if shadow is not None]

    def _write_into(self, targets: list[torch.Tensor], indices: list[int], average: str | None) -> None:
        """Copy the average's tensors ``indices`` into ``targets`` (the tensors the forward reads)."""
        state = self._state
        shadows = state.average(average).shadows
        with torch.no_grad():
            state.strategy.release_gathered()
            if state.strategy.swap_gathers:  # each rank averages a part of tensors it holds whole
                where = {state.infos[i].name: i for i in indices}
                for info, full in state.gathered(dst=None, average=average):
                    if info.name in where:
                        targets[where[info.name]].copy_(full.view_as(targets[where[info.name]]))
            else:
                torch._foreach_copy_([targets[i] for i in indices], [shadows[i] for i in indices])

    def full_state_dict(self, average: str | None = None) -> dict[str, torch.Tensor]:
        """Collective: rank 0 gets ``{name: full tensor}`` on CPU, every name of the plain model; others ``{}``.

        Averaged parameters come in the shadow dtype; frozen parameters and ignored buffers
        carry their live values. Gathered one bounded bucket at a time. ``average`` names which
        one when the averager keeps several.
        """
        result: dict[str, torch.Tensor] = {}
        for info, full in self._state.gathered(dst=0, average=average):
            if full is not None:
                full = full.cpu()
                for name in info.names:
                    result[name] = full
        return result

    def copy_to(self, module: nn.Module, average: str | None = None) -> None:
        """Collective: write the averaged weights into ``module`` (a plain, unsharded model) on every rank.

        Every rank gets the same values, rank 0's ``full_state_dict()``: where ranks hold their
        own copy of a tensor (BatchNorm statistics without SyncBatchNorm), the owner's wins.
        """
        self._state.average(average)  # a wrong name is refused before anything else
        target = module.state_dict(keep_vars=True)
        expected = {name: info.shape for info in self._state.infos for name in info.names}
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
            for info, full in self._state.gathered(dst=None, average=average):
                for name in info.names:
                    target[name].copy_(full)

    # ------------------------------------------------------------------ checkpoints and export

    def state_dict(self) -> dict[str, Any]:
        """DCP Stateful: put the averager in ``dcp.save({..., "ema": avg})``; collective there.

        Every tensor is the global tensor in its own shape, of which this rank holds the boxes it
        owns (a DTensor over ``LocalShardsWrapper``), so ``dcp.load`` reshards to any layout,
        world size or strategy; ``meta`` is a JSON description (counters, rule, names, shapes).
        """
        return stateful.state_dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore from ``state_dict()`` as filled by ``dcp.load``.

        Names and shapes must match (missing, unexpected and mis-shaped tensors are listed);
        a different rule raises unless ``strict=False``, which warns. The tensors are read by
        DCP before this check, straight into the shadows.
        """
        stateful.load_state_dict(self._state, state_dict, strict)

    def save(
        self, directory: str | os.PathLike, keep_last: int | None = None, dtype: torch.dtype | None = None
    ) -> Path:
        """Collective: an atomic sharded checkpoint of the averager alone (safetensors + JSON).

        With ``keep_last=K``, saves to ``directory/step-NNNNNNNNN`` and keeps the K newest.
        ``dtype`` (e.g. ``torch.bfloat16``) stores floating tensors in that dtype.
        """
        return checkpoint.save(self._state, directory, keep_last, dtype)

    def load(self, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
        """Collective: restore from ``save``'s checkpoint (or the newest in a ``keep_last`` directory),
        at any world size and strategy, reading one save whole even while another process saves
        there. ``verify`` first hashes every file against the SHA-256 recorded when it was written
        (the ranks share the work). Returns the checkpoint loaded."""
        return checkpoint.load(self._state, directory, strict, verify)

    def restart(self, step: int) -> None:
        """Restart every average from the live weights, as if its first update at ``step`` had copied
        them: what a resume does when the checkpoint it loaded has no average (``strict=False``)."""
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"restart(step={step}): a step is >= 0")
        self._state.reseed(step)

    def check_checkpoint(self, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
        """Collective: what ``load(directory, strict, verify)`` would refuse, refused now, with nothing
        changed: call it before an engine loads its own part of the same checkpoint, so that a
        damaged average never leaves the weights of one step beside the average of another."""
        return checkpoint.check(self._state, directory, strict, verify)

    def export(
        self,
        path: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        average: str | None = None,
    ) -> Path:
        """Collective: write the full average to the directory ``path`` as safetensors (rank 0 writes).

        Gathered a bounded bucket at a time; above ``max_shard_size`` it is split into
        ``model-0000k-of-0000N.safetensors`` files with ``model.safetensors.index.json``.
        ``dtype`` casts floating tensors (e.g. ``torch.bfloat16`` for deployment). ``average``
        names which one when the averager keeps several.
        """
        return export_model(self._state, path, max_shard_size, dtype, average)

    def shadow_bytes(self) -> int:
        """Bytes of shadow storage on this rank."""
        return self._state.shadow_bytes()

    def __repr__(self) -> str:
        state = self._state
        return (
            f"WeightAverager(rules={self.rules!r}, strategy={state.strategy.name!r}, tensors={len(state.infos)}, "
            f"num_updates={state.num_updates}, step={state.step})"
        )


def _named_rules(rule: Rule | MultiAvgFn | Mapping[str, Rule | MultiAvgFn]) -> dict[str | None, Rule]:
    """``{None: rule}`` for one rule; the named rules of a dict, each name checked."""
    if not isinstance(rule, Mapping):
        return {None: as_rule(rule)}
    if not rule:
        raise ValueError("rule={} names no average: give at least one, e.g. {'ema': EMA(decay=0.999)}")
    bad = [name for name in rule if not (isinstance(name, str) and AVERAGE_NAME.match(name))]
    if bad:
        raise ValueError(
            f"average names {bad!r} are not plain names: use letters, digits, '_' and '-' (no dots or slashes, "
            "which join checkpoint keys), starting with a letter or '_', at most 64 characters"
        )
    return {name: as_rule(value) for name, value in rule.items()}
