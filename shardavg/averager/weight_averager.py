"""``WeightAverager``: an average of a model's weights kept next to the shards each rank owns.

The flow is engine -> strategy -> averager: the strategy says which tensors exist and
where this rank's shard of each is (its *local shard*); the averager keeps a shadow of every
local shard and updates it in place with a few fused ``torch._foreach_*`` calls, with no
communication. Full tensors are gathered only on request (``full_state_dict``, ``copy_to``,
``export``), one bounded bucket at a time. This class is the front: the state lives in
``average_state.py``, the update in ``update/updater.py``, swapping in ``swap.py``, gathers and exports in
``export.py``, checkpoints in ``checkpoint.py`` and ``stateful.py`` (all but the update in ``averager/``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ..base import validate
from ..base.dist import agree_or_raise
from ..base.logs import built_by_user, log
from ..output.write_options import DEFAULTS
from ..rules import EMA, AvgFn, MultiAvgFn, Rule, named_rules
from ..strategies import make_strategy, megatron
from ..update.background import wait_for_every_update
from ..update.options import Options
from . import batchnorm, checkpoint, export, stateful, swap
from .average_state import AverageState

DEFAULT_RULE = EMA(decay=0.999)


def checked_options(keywords: Mapping[str, Any]) -> Options:
    """The ``Options`` that ``WeightAverager``'s keyword arguments name (its own ``strategy``,
    ``source`` and ``pipeline`` left out), checked: what integrations call where they take an
    averager's keywords, so that a bad one is refused there rather than when the averager is built.

    Args:
        keywords: ``WeightAverager``'s keyword arguments.

    Returns:
        The options.

    Raises:
        TypeError: A keyword that is neither an option nor one of ``WeightAverager``'s own.
        ValueError: An option out of its range or not one of its choices.
    """
    own = tuple(p.name for p in inspect.signature(WeightAverager).parameters.values() if p.kind is p.KEYWORD_ONLY)
    return Options.from_keywords(keywords, "WeightAverager", own)


Method = TypeVar("Method", bound=Callable[..., Any])


def _after_the_update(method: Method) -> Method:
    """The method, once the update running in the background (if any) has landed."""

    @functools.wraps(method)
    def waiting(self: WeightAverager, *args: Any, **kwargs: Any) -> Any:
        self._state.updater.wait()
        return method(self, *args, **kwargs)

    return waiting  # type: ignore[return-value]


class WeightAverager:
    """Keeps an average (EMA, SWA, power EMA, any rule) of a model's weights, shard by shard.

    Each rank keeps a shadow of the part of every tensor it holds and updates it in place with
    no communication; full tensors are gathered only on request (``full_state_dict``,
    ``copy_to``, ``export``). Building the averager is a collective.

    Args:
        model: A ``DeepSpeedEngine``, an FSDP1 module, a module with DTensor parameters
            (``fully_shard``, tensor or expert parallel, any mix), a Megatron-Core model (or this
            rank's list of its virtual-pipeline chunks), a DDP module or a plain ``nn.Module``;
            with ``pipeline``, this rank's stage (or a list of its stages).
        rule: ``EMA(...)``, ``SWA()``, ``PowerEMA(...)``, a ``multi_avg_fn(shadows, lives,
            num_updates)`` such as ``get_ema_multi_avg_fn(0.999)``, or a dict of them to keep
            several named averages (``{"ema": EMA(decay=0.999), "swa": SWA()}``), which share one
            read of the local shards per update; methods that use one average then take its name.
            None (default): ``EMA(decay=0.999)``, or ``avg_fn``'s rule.
        avg_fn: A per-tensor ``avg_fn(averaged, current, num_averaged)`` in place of ``rule``, such
            as ``get_ema_avg_fn(0.999)``: applied as ``AveragedModel(model, avg_fn=...)`` applies it,
            to each local shard, so it must be elementwise (see
            [`AvgFnRule`][shardavg.AvgFnRule]). A callable given as ``rule`` is a ``multi_avg_fn``;
            torch's per-tensor ones given there are refused, naming ``avg_fn=``.
        strategy: ``"auto"`` (detect, see [`detect`][shardavg.detect]) or one of ``"replicated"``,
            ``"fsdp1"``, ``"fsdp2"``, ``"zero3"``, ``"megatron"``; a forced strategy that does not fit
            the model is refused.
        source: ``"live"`` (the weights the model holds) or ``"master"`` (a DeepSpeed ZeRO-1/2/3
            engine's fp32 masters: this rank's part of them).
        pipeline: The process group or mesh of this rank's pipeline, as ``PipelineStage`` gets it;
            every stage's tensors are then gathered, exported and saved, the stage's own updated.
            None: a model not cut into stages.
        **options: The settings (the update's cadence, the shadows' dtype and device, what is kept
            of buffers and frozen parameters, non-finite weights, the background thread), keyword
            only: each is a field of [`Options`][shardavg.update.options.Options], documented there.

    Attributes:
        rule: The rule of the only average.
        rules: Each average's rule, by name (``None`` for a single unnamed average).
        options: The settings ([`Options`][shardavg.update.options.Options]) it was built with.
        strategy: The engine's strategy in use.
        layout: Which rank holds which part of every tensor.
        step: The last step seen by ``update()`` (restored by ``load``).
        tensors: Each tensor tracked (a ``TensorInfo``), with this rank's part.
        updater: The update pipeline (``Updater``), for tests and tools.

    Raises:
        StrategyError: An unknown ``strategy`` or ``source``, one that does not fit the model, a
            list of parts without ``pipeline``, or tensors this rank's engine holds in a way
            shardavg cannot read (a ``Partial`` DTensor, ZeRO++ or NVMe offload).
        ValueError: An option out of its range, or a dict of rules with no or badly named averages.
        TypeError: ``rule`` is neither a rule nor a callable (or is a per-tensor ``avg_fn``), both ``rule``
            and ``avg_fn`` are given, or a keyword is not one of its own nor an option.
        LayoutError: The ranks track different tensors, or their parts do not tile a tensor.

    Examples:
        One process; under torchrun every rank runs the same lines.

        >>> import torch, shardavg
        >>> model = torch.nn.Linear(4, 2)
        >>> avg = shardavg.WeightAverager(model, shardavg.EMA(decay=0.9))
        >>> for _ in range(3):
        ...     with torch.no_grad():
        ...         _ = model.weight.add_(1.0)   # what an optimizer step would do
        ...     _ = avg.update()
        >>> avg.num_updates
        3
        >>> with avg.swapped():              # the model holds the average inside the block
        ...     bool(torch.equal(model.weight, avg.full_state_dict()["weight"]))
        True
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        rule: Rule | MultiAvgFn | Mapping[str, Rule | MultiAvgFn] | None = None,
        *,
        avg_fn: AvgFn | None = None,
        strategy: str = "auto",
        source: str = "live",
        pipeline: Any = None,
        **options: Any,
    ) -> None:
        settings = checked_options(options)
        rules = named_rules(DEFAULT_RULE if rule is None and avg_fn is None else rule, avg_fn)
        made = make_strategy(model, strategy, source, pipeline)
        self._state = state = AverageState(made, rules, settings)
        narrowed = state.narrowed()
        if narrowed:
            warnings.warn(
                f"{len(narrowed)} shadows are {settings.dtype}, below their live dtype: {narrowed}", stacklevel=2
            )
        if built_by_user():  # (not the averagers post-hoc synthesis builds for itself)
            log.info("shardavg: %s", state.summary())

    rule = property(lambda self: self._state.average(None).rule, doc="The rule of the only average.")
    rules = property(lambda self: {n: a.rule for n, a in self._state.averages.items()}, doc="Each average's rule.")
    options = property(lambda self: self._state.options, doc="The settings (``Options``) it was built with.")
    strategy = property(lambda self: self._state.strategy, doc="The engine's strategy in use.")
    layout = property(lambda self: self._state.layout, doc="Which rank holds which part of every tensor.")
    step = property(lambda self: self._state.step, doc="The last step seen by update() (restored by load).")

    tensors = property(lambda self: list(self._state.infos), doc="Each tensor tracked, with this rank's part.")
    updater = property(lambda self: self._state.updater, doc="The update pipeline (``Updater``), for tests and tools.")

    @_after_the_update
    def shadows(self, average: str | None = None) -> list[torch.Tensor | None]:
        """This rank's shadow of each tensor of an average, for inspection.

        Write into them only to restore a state you read from them.

        Args:
            average: The average's name; None for the only one.

        Returns:
            One entry per tracked tensor (``tensors`` order): its shadow, or None where it is not
                stored (frozen parameters, ignored buffers).

        Raises:
            ValueError: No average of that name, or None while several averages are kept.
        """
        return list(self._state.average(average).shadows)

    @property
    def num_updates(self) -> int:
        """Updates applied (restored by ``load``).

        Waits for the update in the background, and reads the pending verdicts of updates checked
        on an accelerator (raising or warning for a non-finite one, as ``on_nonfinite`` says).
        """
        self._state.updater.wait()
        self._state.updater.settle()
        return self._state.num_updates

    @property
    def num_skipped(self) -> int:
        """Updates skipped: for non-finite live weights, or a false verdict from the loop
        (``update(finite=...)``); waits and reads verdicts, as ``num_updates``."""
        self._state.updater.wait()
        self._state.updater.settle()
        return self._state.num_skipped

    @property
    def run_id(self) -> str | None:
        """The run's identity (32 lower-case hex digits), written into every checkpoint saved.

        Restored by ``load``; None unless set (``PostHocEMA`` sets it to tell its snapshots from
        another run's). Setting anything else raises ``ValueError``.
        """
        return self._state.run_id

    @run_id.setter
    def run_id(self, value: str | None) -> None:
        validate.run_id(value)
        self._state.run_id = value

    @property
    def gather_bucket_bytes(self) -> int:
        """What a gather holds at once on a receiving rank, beyond the largest single tensor.

        Bounds ``full_state_dict``, ``copy_to`` and ``export``; 64 MiB by default. Setting
        anything but an int >= 1 raises ``ValueError``.
        """
        return self._state.gather_bucket_bytes

    @gather_bucket_bytes.setter
    def gather_bucket_bytes(self, value: int) -> None:
        validate.count("gather_bucket_bytes", value, 1)
        self._state.gather_bucket_bytes = value

    def update(self, step: int | None = None, *, finite: bool | torch.Tensor | None = None) -> bool:
        """Average the local shards in; call after ``optimizer.step()``, every step. No communication.

        The update runs at ``start_step + k * every_n_steps``, the first one copying. A refused
        call changes nothing.

        ``finite`` is the verdict the loop already has on its step, so that the non-finite screen
        (one more read of every live byte) need not run: the total gradient norm that
        ``clip_grad_norm_`` returned (``avg.update(finite=total_norm)``), or False where the
        optimizer skipped the step (a loss scaler's overflow). With finite gradients a torch
        optimizer moves each weight by a finite amount, so a true verdict says what the screen
        would find, given finite weights before: the screen still runs at the first update, the
        first after ``load``/``load_state_dict``/``restart``/``copy_into_model``, after a step
        called without a verdict, after a screen that found NaN, and every ``screen_every``
        updates; and at every false verdict, at its own step (the step is skipped, but its
        optimizer may have written NaN: ``clip_grad_norm_`` scales infinite gradients by 0, and
        inf * 0 is NaN), where ``on_nonfinite`` applies to what it finds. A verdict does not see
        writes outside the optimizer (a hand-written one, ``model.load_state_dict``) nor an
        optimizer that is not a torch one: see the usage guide. On CUDA a tensor verdict stays on
        the device and masks the update there (no host read); in the background it is taken at
        this call (the loop may reuse its tensor).

        Args:
            step: The optimizer step count; None (default): one more than the last seen.
            finite: The loop's verdict on the step: a bool, a 0-d bool tensor, or a floating tensor
                (any shape) that is finite when all its elements are. None (default): no verdict,
                the screen runs as ``on_nonfinite`` says. A false verdict skips the update and
                screens the weights.

        Returns:
            Whether an update was applied (with ``background=True``: started; with a verdict on
            the device: issued, and counted skipped later if the verdict was false).

        Raises:
            RuntimeError: Called inside ``swapped()``.
            ValueError: ``step`` is a bool or not after the last step seen; ``finite`` is a bool
                tensor of more than one element, an empty tensor, a tensor on the meta device, or a
                DTensor that is not replicated.
            TypeError: ``finite`` is not a bool or a bool or floating tensor.
            NonFiniteError: A live weight holds NaN or infinity under ``on_nonfinite="raise"``
                (in the background, or checked on an accelerator, raised at the next call instead:
                an ``update()`` that raises for an earlier step has taken no step of its own),
                whatever the verdict: a false one with finite weights only warns.
            RuntimeError: An earlier update stopped part way (an interrupt between two averages'
                kernels): the average is refused until ``load()`` or ``restart()``.

        Warns:
            RuntimeWarning: An update skipped under ``on_nonfinite="skip"``, or for a false verdict
                under ``"raise"`` and ``"skip"`` (silently under ``"off"``), naming its step: at once,
                or (in the background, or checked on an accelerator) at the next call, in its thread.
        """
        if self._state.swapped:
            raise RuntimeError("update() inside swapped(): the live model holds averaged weights")
        return self._state.updater.update(step, finite)

    def wait(self) -> None:
        """Wait for the update running in the background (``background=True``).

        Every method here does this first, and so does every torch optimizer's ``step()``, the
        forward of a module that writes its own weights (an embedding with ``max_norm``), and
        every averager's ``swapped()`` and ``copy_into_model()``; call it before writing the live
        weights any other way (``model.load_state_dict``, a hand-written update, an optimizer that
        is not a ``torch.optim.Optimizer``). A write through a tensor's in-place methods that did
        not wait is seen when the update is collected: an error, and from then on every use of the
        average (``update()``, ``swapped()``, gathers, exports, saves) is refused until ``load()``,
        ``load_state_dict()`` or ``restart()`` restores it. Writes through ``.data`` are not seen.

        An interrupt (Ctrl-C) while waiting propagates at once and leaves the update in flight:
        the next call of any kind waits for it again, so a save in ``except KeyboardInterrupt``
        writes the average whole.

        Raises:
            Exception: What the background update raised (``NonFiniteError``, out of memory, ...),
                once.
            RuntimeError: The update read weights something else wrote while it ran, once.
        """
        self._state.updater.wait()

    @_after_the_update
    def restart(self, step: int) -> None:
        """Restart every average from the live weights, as if its first update at ``step`` had copied them.

        This is what a resume does when the checkpoint it loaded has no average (``strict=False``).

        Args:
            step: The step of the copying update (the step the live weights are at).

        Raises:
            ValueError: ``step`` is negative.
        """
        self._state.restart(validate.step(f"restart(step={step})", step))

    @_after_the_update
    def combine(self, sources: Iterable[tuple[WeightAverager, str | None, float]], step: int, num_updates: int) -> None:
        """Set the only average to a weighted sum of other averagers' averages: post-hoc synthesis's result.

        Shard by shard; copied tensors are taken from the last source. Each source is read when the
        iterable yields it, so one averager reloaded between terms serves.

        Args:
            sources: ``(averager, name, weight)`` terms, each averager of the same model with the
                same parts; ``name`` picks its average (None: its only one).
            step: The step count to set.
            num_updates: The update count to set.

        Raises:
            ValueError: This averager keeps several averages, or a source has no average ``name``.
        """
        terms = ((source.shadows(name), weight) for source, name, weight in sources)
        self._state.combine(terms, step, num_updates)

    @_after_the_update
    def swapped(self, average: str | None = None) -> AbstractContextManager[None]:
        """A context in which the live model holds an average.

        Shard-local, no gather (but under ZeRO-1/2 masters, where every rank holds the whole
        model: a collective there). The local shards come back bit for bit on exit, also when the
        block raises.

        Args:
            average: The average's name; None for the only one.

        Returns:
            A context manager; the errors below are raised on entering it.

        Raises:
            ValueError: No average of that name, or None while several averages are kept.
            RuntimeError: No update applied yet, or already inside ``swapped()``.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        return swap.swapped(self._state, average)

    @_after_the_update
    def copy_into_model(self, average: str | None = None) -> None:
        """Write the average into the live model for good, as ``swapped()`` does on entry.

        To go on training from it, or save it with the engine's own checkpoints: the live weights
        are lost.

        Args:
            average: The average's name; None for the only one.

        Raises:
            ValueError: No average of that name, or None while several averages are kept.
            RuntimeError: No update applied yet, or inside ``swapped()``.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        swap.copy_into_model(self._state, average)

    @_after_the_update
    def update_bn(
        self, loader: Iterable[Any], device: torch.device | str | None = None, average: str | None = None
    ) -> list[str]:
        """Recompute the BatchNorm statistics under an average and keep them in it: torch's
        ``update_bn(loader, model, device)`` run inside ``swapped()``, the running statistics it
        leaves written into the average's buffers before the live ones come back (SWA's last
        step; ``shardavg.update_bn(loader, avg)`` is the same call in torch's order).

        Collective where the forward is (FSDP, ZeRO-3, tensor parallel): call it on every rank,
        with loaders of the same length. Each rank's statistics are those of the batches its own
        loader gives it; to have the statistics torch's ``update_bn`` computes on the gathered
        model over a data set, give every rank that whole data set (not a ``DistributedSampler``'s
        part of it), as the exported average holds one rank's statistics.

        Args:
            loader: Batches as torch's ``update_bn`` takes them (a tensor, or a list or tuple whose
                first element is the model's input).
            device: Where each batch is moved first; None leaves it where it is.
            average: The average's name; None for the only one.

        Returns:
            The names of the statistics kept (none where the model has no BatchNorm or the
            averager stores no buffer, ``buffers="ignore"``).

        Raises:
            ValueError: No average of that name, or None while several averages are kept, or
                several averages sharing one copy of the statistics (``buffers="copy"``).
            RuntimeError: No update applied yet, or inside ``swapped()``.
        """
        return batchnorm.update_bn(loader, self._state, average, device)

    @_after_the_update
    def full_state_dict(self, average: str | None = None, live: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the full average as a plain state dict on rank 0.

        Frozen parameters and ignored buffers carry their live values. Gathered one bounded bucket
        at a time (``gather_bucket_bytes``).

        Args:
            average: The average's name; None for the only one.
            live: Gather the live weights instead of the average.

        Returns:
            On rank 0 ``{name: full tensor}`` on CPU, every name of the plain model (tied weights
                under each name); ``{}`` on the other ranks.

        Raises:
            ValueError: No average of that name, or None while several averages are kept.
            RuntimeError: No update applied yet (unless ``live``), or the ranks applied different
                updates.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        return export.full_state_dict(self._state, average, live)

    @_after_the_update
    def copy_to(self, module: nn.Module, average: str | None = None) -> None:
        """Collective: write an average into a plain model on every rank, the same values everywhere.

        Where ranks hold their own copy of a buffer, its owner's value is written. Waits for every
        update in flight in the process first: ``module`` may be the live model of another averager.

        Args:
            module: A plain (unsharded) model with the averaged model's names and shapes.
            average: The average's name; None for the only one.

        Raises:
            ValueError: ``module`` does not match the averaged model, or no average of that name.
            RuntimeError: No update applied yet, or the ranks applied different updates.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        wait_for_every_update()
        export.copy_to(self._state, module, average)

    @_after_the_update
    def export(
        self,
        path: str | os.PathLike,
        max_shard_size: int | str = DEFAULTS.max_shard_size,
        dtype: torch.dtype | None = DEFAULTS.dtype,
        average: str | None = None,
        live: bool = False,
        writers: int | None = DEFAULTS.writers,
    ) -> Path:
        """Collective: write the full average as safetensors into a model folder.

        Every rank writes: its own parts where they lie in the files (parameters sharded in
        ranges: rows, flat shards), and about 1/W of the rest, received a bounded bucket at a time.
        The files are the same whatever the number of writers.

        Args:
            path: The folder; every writer must see it (a shared file system).
            max_shard_size: Above this size (bytes, or a string such as ``"2GB"``, ``"500MiB"``;
                default ``WriteOptions.max_shard_size``) the Hugging Face sharded layout with its
                index is written.
            dtype: Cast floating tensors to this dtype; None keeps each tensor's own.
            average: The average's name; None for the only one.
            live: Write the live weights instead of the average.
            writers: ``k`` ranks spread over the world receive and write everything; ``1``: rank 0
                alone, for a file system that cannot take concurrent writers; None (default): every
                rank.

        Returns:
            The folder written.

        Raises:
            ValueError: A bad ``max_shard_size``, ``dtype``, ``writers``, empty ``path`` or average name.
            ExportError: The folder is not shardavg's to write, the ranks name different folders or
                arguments, a tensor cannot be cast, or a rank failed to write.
            RuntimeError: No update applied yet (unless ``live``), or the ranks applied different
                updates.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        return export.export(self._state, path, max_shard_size, dtype, average, live, writers)

    @_after_the_update
    def state_dict(self) -> dict[str, Any]:
        """DCP Stateful: ``dcp.save({..., "ema": avg})`` (collective there).

        Each tensor in its own shape, this rank holding the boxes it owns, so ``dcp.load``
        reshards to any layout or world size.

        Returns:
            ``{"meta": ..., "tensors": {key: tensor}}``, for DCP to save.

        Raises:
            ModelChangedError: The model's tensors are no longer those the averager was built on.
            RuntimeError: A background update read weights something else wrote (see ``wait``).
        """
        self._state.updater.require_whole("state_dict()")
        return stateful.state_dict(self._state)

    @_after_the_update
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore from ``state_dict()`` as ``dcp.load`` filled it.

        Checked on every rank before anything changes.

        Args:
            state_dict: What ``dcp.load`` filled in.
            strict: Refuse missing or unexpected tensors, tensors stored differently, other averages
                or another rule; with False, warn about them instead (what is missing is averaged
                from the live weights on). Shapes must match either way.

        Raises:
            CheckpointError: Not a shardavg state dict, shapes or dtypes that do not match, or
                (under ``strict``) any difference above.
        """
        stateful.load_state_dict(self._state, state_dict, strict)

    @_after_the_update
    def sharded_state_dict(
        self, prefix: str = "ema.", average: str | None = None, metadata: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Megatron-Core only: the average as Megatron's own checkpoints describe the model.

        One ``ShardedTensor`` per tensor this rank holds, built from the model's own
        ``sharded_state_dict(metadata=metadata)`` (the same offsets, fragmentation, replica ids and
        stacked layer axes) with this rank's shadow as data and ``prefix`` before every key; and the
        counters (``num_updates``, ``step``), kept by every rank and written by rank 0. So
        Megatron's ``dist_checkpointing`` saves the average beside the model and optimizer in one
        checkpoint, and loads it at any other TP/PP/DP layout::

            from megatron.core import dist_checkpointing
            dist_checkpointing.save({**model.sharded_state_dict(), **avg.sharded_state_dict()}, folder)
            # resume (any layout): the averager's own sharded_state_dict() is the load template
            loaded = dist_checkpointing.load({**model.sharded_state_dict(), **avg.sharded_state_dict()}, folder)
            avg.load_sharded_state_dict(loaded)

        With ``prefix=""`` the checkpoint is the averaged model itself, under the model's own keys:
        ``dist_checkpointing.load(model.sharded_state_dict(), folder)`` loads it into a ``GPTModel``
        for evaluation or serving, at any layout. The tensors are the shadows themselves (the
        template loads into them in place); frozen parameters carry copies of their live values.
        Under a virtual pipeline the chunks' entries are under ``{prefix}model0``, ``{prefix}model1``...

        Args:
            prefix: Put before every key (Megatron's and the dict's), so the average does not
                collide with the model in one checkpoint. Default ``"ema."``.
            average: The average's name; None for the only one.
            metadata: Megatron's ``sharded_state_dict`` metadata, as the model's own call gets it.

        Returns:
            A sharded state dict for ``dist_checkpointing.save`` / ``load``.

        Raises:
            TypeError: ``prefix`` is not a str.
            StrategyError: The averager does not average a Megatron-Core model (save with ``save``
                or ``state_dict`` then).
            ValueError: No average of that name, or None while several averages are kept.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        if not isinstance(prefix, str):
            raise TypeError(
                f"sharded_state_dict(prefix={prefix!r}): prefix must be a str, put before every key of the "
                "average: 'ema.' (the default) beside the model in one checkpoint, '' for the model's own keys"
            )
        state = self._state
        state.updater.require_whole("sharded_state_dict()")
        state.verify_structure()
        name = state.average(average).name
        values = [
            state.flat_part(index, name) if state.stored(index) else state.flat_part(index, live=True).clone()
            for index in range(len(state.infos))
        ]
        counters = torch.tensor([self.step, self.num_updates, self.num_skipped], dtype=torch.int64)
        names = [info.name for info in state.infos]
        return megatron.sharded_average(state.strategy, names, values, counters, prefix, metadata)

    @_after_the_update
    def load_sharded_state_dict(
        self, state_dict: Mapping[str, Any], prefix: str = "ema.", average: str | None = None
    ) -> None:
        """Collective, Megatron-Core only: restore an average from what ``dist_checkpointing.load`` returned.

        The load's template must hold this averager's own ``sharded_state_dict(prefix, average)``
        (built on the model as it is now laid out, at any TP/PP/DP): Megatron then reshards the
        saved average into its shadows in place, and this takes the counters and checks that
        every tensor came back (copying any that was loaded elsewhere). Checked on every rank
        before anything changes.

        Args:
            state_dict: What ``dist_checkpointing.load`` returned.
            prefix: The prefix the average was saved under.
            average: The average's name; None for the only one.

        Raises:
            TypeError: ``prefix`` is not a str (on every rank that passed it, before any collective).
            CheckpointError: On every rank, naming the rank and its reason: a tensor or the counters
                missing, or of another shape than this rank's slice; no average of that name; or the
                averager does not average a Megatron-Core model.
        """
        if not isinstance(prefix, str):
            raise TypeError(
                f"load_sharded_state_dict(prefix={prefix!r}): prefix must be a str, the one the average was "
                "saved under by sharded_state_dict(prefix=...): 'ema.' by default"
            )
        state = self._state
        error: BaseException | None = None
        try:
            name = state.average(average).name
            found, counters = megatron.loaded_average(state.strategy, [i.name for i in state.infos], state_dict, prefix)
        except Exception as caught:  # raised on every rank below, not here alone
            error = caught
        agree_or_raise(error, "loading the averager's sharded state dict")
        with torch.no_grad():
            for index, value in found.items():
                if state.stored(index):
                    target = state.flat_part(index, name)
                    if target.data_ptr() != value.data_ptr():  # (loaded in place otherwise)
                        target.copy_(value.reshape(-1))
        step, num_updates, num_skipped = (int(count) for count in counters.tolist())
        every = {key for index in range(len(state.infos)) for key, _ in state.keys(index)}
        state.resume(
            dataclasses.replace(state.describe(), step=step, num_updates=num_updates, num_skipped=num_skipped), every
        )

    @_after_the_update
    def save(
        self, directory: str | os.PathLike, keep_last: int | None = None, dtype: torch.dtype | None = None
    ) -> Path:
        """Collective: an atomic sharded checkpoint of the averager alone (safetensors + JSON).

        Args:
            directory: The checkpoint folder, replaced whole; with ``keep_last``, the folder that
                holds the step checkpoints.
            keep_last: Save into ``directory/step-NNNNNNNNN`` and keep the ``keep_last`` newest of
                shardavg's own there; None (default): save ``directory`` itself.
            dtype: Store the averaged tensors in this dtype (loading casts them back); None keeps
                the shadows' dtype.

        Returns:
            The committed checkpoint's path.

        Raises:
            ValueError: A bad ``keep_last`` or ``dtype``, or an empty ``directory``.
            CheckpointError: Something not written by shardavg is in the way, the target lies inside
                another checkpoint, or another process is writing there.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
            RuntimeError: A background update read weights something else wrote (see ``wait``).
        """
        self._state.updater.require_whole("save()")
        return checkpoint.save(self._state, directory, keep_last, dtype)

    @_after_the_update
    def load(self, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
        """Collective: restore a checkpoint written by ``save``, at any layout or world size.

        One save is read whole, even while another process saves there. Everything is checked on
        every rank before any shadow changes.

        Args:
            directory: A checkpoint, or a ``keep_last`` folder (its newest checkpoint is loaded).
            strict: Refuse missing or unexpected tensors, tensors stored differently, other averages
                or another rule; with False, warn about them instead (what is missing is averaged
                from the live weights on). Shapes must match either way.
            verify: Hash every file against its recorded SHA-256 first.

        Returns:
            The checkpoint loaded.

        Raises:
            CheckpointError: The checkpoint is missing, uncommitted, corrupt or not shardavg's, its
                shapes do not match, or (under ``strict``) it differs as above.
            ModelChangedError: The model's tensors are no longer those the averager was built on.
        """
        return checkpoint.load(self._state, directory, strict, verify)

    def check_checkpoint(self, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
        """Collective: refuse now what ``load(directory, strict, verify)`` would refuse, changing nothing.

        Call it before an engine loads its own part of the same checkpoint, so that a damaged
        average never leaves the weights of one step beside the average of another.

        Args:
            directory: As for ``load``.
            strict: As for ``load``.
            verify: As for ``load``.

        Returns:
            The checkpoint ``load`` would read.

        Raises:
            CheckpointError: As ``load`` would raise it.
        """
        return checkpoint.check(self._state, directory, strict, verify)

    def shadow_bytes(self) -> int:
        """Bytes of shadow storage on this rank.

        Returns:
            The bytes every average's shadows take on this rank.
        """
        return self._state.shadow_bytes()

    @_after_the_update
    def __repr__(self) -> str:
        return f"WeightAverager(rules={self.rules!r}, {self._state.summary()}, num_updates={self._state.num_updates})"


def update_bn(
    loader: Iterable[Any],
    averager: WeightAverager,
    device: torch.device | str | None = None,
    average: str | None = None,
) -> list[str]:
    """``torch.optim.swa_utils.update_bn(loader, model, device)`` for an average kept by ``averager``,
    in torch's order: see ``WeightAverager.update_bn``."""
    return averager.update_bn(loader, device, average)
