"""``WeightAverager``: an average of a model's weights kept next to the shards each rank owns.

The flow is engine -> strategy adapter -> averager: the adapter says which tensors exist and
where this rank's shard of each is (its *local view*); the averager keeps a shadow of every
local view and updates it in place with a few fused ``torch._foreach_*`` calls, with no
communication. Full tensors are gathered only on request (``full_state_dict``, ``copy_to``,
``export``), one bounded bucket at a time. This class is the front: the state lives in
``state.py``, the update in ``update.py``, swapping in ``swap.py``, gathers and exports in
``export.py``, checkpoints in ``checkpoint.py`` and ``stateful.py``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from . import checkpoint, export, stateful, swap, validate
from .logs import built_by_user, log
from .options import BufferPolicy, NonfinitePolicy, Options
from .rules import EMA, MultiAvgFn, Rule, named_rules
from .state import AverageState
from .strategies import make_strategy

DEFAULT_RULE = EMA(decay=0.999)

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

    Args:
        model: a ``DeepSpeedEngine``, an FSDP1 module, a module with DTensor parameters
            (``fully_shard``, tensor or expert parallel, any mix), a DDP module or a plain
            ``nn.Module``; with ``pipeline``, this rank's stage (or a list of its stages).
            Building the averager is a collective.
        rule: ``EMA(...)``, ``SWA()``, ``PowerEMA(...)``, a ``multi_avg_fn(shadows, lives,
            num_updates)`` such as ``get_ema_multi_avg_fn(0.999)``, or a dict of them to keep
            several named averages (``{"ema": EMA(decay=0.999), "swa": SWA()}``), which share one
            read of the live shards per update; methods that use one average then take its name.
        strategy: ``"auto"`` (detect) or one of ``"replicated"``, ``"fsdp1"``, ``"fsdp2"``,
            ``"zero3"``; a forced strategy that does not fit the model is refused.
        source: ``"live"`` (the weights the model holds) or ``"master"`` (a DeepSpeed ZeRO-1/2/3
            engine's fp32 masters: this rank's part of them).
        pipeline: the process group or mesh of this rank's pipeline, as ``PipelineStage`` gets it;
            every stage's tensors are then gathered, exported and saved, the stage's own updated.

    The other arguments (``every_n_steps``, ``start_step``, ``dtype``, ``buffers``, ``device``,
    ``include_frozen``, ``on_nonfinite``, ``background``) say how to average: see ``Options``
    (``avg.options``).

    Example (one process; under torchrun every rank runs the same lines)::

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
        rule: Rule | MultiAvgFn | Mapping[str, Rule | MultiAvgFn] = DEFAULT_RULE,
        *,
        strategy: str = "auto",
        every_n_steps: int = 1,
        start_step: int = 0,
        dtype: torch.dtype | None = torch.float32,
        buffers: BufferPolicy = "copy",
        device: torch.device | str | None = None,
        include_frozen: bool = False,
        on_nonfinite: NonfinitePolicy = "raise",
        background: bool = False,
        source: str = "live",
        pipeline: Any = None,
    ) -> None:
        options = Options(every_n_steps, start_step, dtype, buffers, device, include_frozen, on_nonfinite, background)
        adapter = make_strategy(model, strategy, source, pipeline)
        self._state = state = AverageState(adapter, named_rules(rule), options)
        narrowed = state.narrowed()
        if narrowed:
            warnings.warn(f"{len(narrowed)} shadows are {dtype}, below their live dtype: {narrowed}", stacklevel=2)
        if built_by_user():  # (not the averagers post-hoc synthesis builds for itself)
            log.info("shardavg: %s", state.summary())

    rule = property(lambda self: self._state.average(None).rule, doc="The rule of the only average.")
    rules = property(lambda self: {n: a.rule for n, a in self._state.averages.items()}, doc="Each average's rule.")
    options = property(lambda self: self._state.options, doc="The settings (``Options``) it was built with.")
    strategy = property(lambda self: self._state.strategy, doc="The engine adapter in use.")
    layout = property(lambda self: self._state.layout, doc="Which rank holds which part of every tensor.")
    step = property(lambda self: self._state.step, doc="The last step seen by update() (restored by load).")

    tensors = property(lambda self: list(self._state.infos), doc="Each tensor tracked, with this rank's part.")
    updater = property(lambda self: self._state.updater, doc="The update pipeline (``Updater``), for tests and tools.")

    @_after_the_update
    def shadows(self, average: str | None = None) -> list[torch.Tensor | None]:
        """This rank's shadow of each tensor of ``average`` (``None`` where not stored), for
        inspection: write into them only to restore a state you read from them."""
        return list(self._state.average(average).shadows)

    @property
    def num_updates(self) -> int:
        """Updates applied (restored by load). Waits for the update in the background, and reads the
        pending verdicts of updates checked on an accelerator (raising or warning for a non-finite one)."""
        self._state.updater.wait()
        self._state.updater.settle()
        return self._state.num_updates

    @property
    def num_skipped(self) -> int:
        """Updates skipped for non-finite live weights (waits and reads verdicts, as ``num_updates``)."""
        self._state.updater.wait()
        self._state.updater.settle()
        return self._state.num_skipped

    @property
    def run_id(self) -> str | None:
        """The run's identity (32 hex digits) written into every checkpoint saved and restored by
        ``load``; None unless set (``PostHocEMA`` sets it to tell its snapshots from another run's)."""
        return self._state.run_id

    @run_id.setter
    def run_id(self, value: str | None) -> None:
        validate.run_id(value)
        self._state.run_id = value

    @property
    def gather_bucket_bytes(self) -> int:
        """What a gather (``full_state_dict``, ``copy_to``, ``export``) holds at once on a receiving
        rank, beyond the largest single tensor (64 MiB by default)."""
        return self._state.gather_bucket_bytes

    @gather_bucket_bytes.setter
    def gather_bucket_bytes(self, value: int) -> None:
        validate.count("gather_bucket_bytes", value, 1)
        self._state.gather_bucket_bytes = value

    def update(self, step: int | None = None) -> bool:
        """Average the live shards in; call after ``optimizer.step()``. No communication.

        ``step`` counts optimizer steps (by default one more than the last seen); the update runs
        at ``start_step + k * every_n_steps``, the first one copying. Returns whether one was
        applied; a refused call (inside ``swapped()``, a step not after the last) changes nothing.
        """
        if self._state.swapped:
            raise RuntimeError("update() inside swapped(): the live model holds averaged weights")
        return self._state.updater.update(step)

    def wait(self) -> None:
        """Wait for the update running in the background (``background=True``), raising its error if
        it met one. Every method here does this first, and so does every torch optimizer's
        ``step()``; call it before writing the live weights any other way."""
        self._state.updater.wait()

    @_after_the_update
    def restart(self, step: int) -> None:
        """Restart every average from the live weights, as if its first update at ``step`` had copied
        them: what a resume does when the checkpoint it loaded has no average (``strict=False``)."""
        self._state.reseed(validate.step(f"restart(step={step})", step))

    @_after_the_update
    def combine(self, sources: Iterable[tuple[WeightAverager, str | None, float]], step: int, num_updates: int) -> None:
        """Set the only average to the sum of ``weight`` times each source averager's average
        ``name`` (same model, same parts), shard by shard, its copied tensors to the last source's
        and its counts to ``step`` and ``num_updates``: post-hoc synthesis's result. Each source is
        read when the iterable yields it, so one averager reloaded between terms serves."""
        terms = ((source.shadows(name), weight) for source, name, weight in sources)
        self._state.combine(terms, step, num_updates)

    @_after_the_update
    def swapped(self, average: str | None = None) -> AbstractContextManager[None]:
        """Inside the block the live model holds ``average``; shard-local, no gather (but under
        ZeRO-1/2 masters, where every rank holds the whole model: a collective there). The live
        shards come back bit for bit on exit, also when the block raises."""
        return swap.swapped(self._state, average)

    @_after_the_update
    def copy_into_model(self, average: str | None = None) -> None:
        """Write the average into the live model for good, as ``swapped()`` does on entry (to go on
        from it, or save it with the engine's own checkpoints): the live weights are lost."""
        swap.copy_into_model(self._state, average)

    @_after_the_update
    def full_state_dict(self, average: str | None = None, live: bool = False) -> dict[str, torch.Tensor]:
        """Collective: on rank 0 ``{name: full tensor}`` on CPU, every name of the plain model; ``{}``
        elsewhere. Frozen parameters and ignored buffers carry their live values; ``live=True``
        gathers the live weights. One bounded bucket at a time."""
        return export.full_state_dict(self._state, average, live)

    @_after_the_update
    def copy_to(self, module: nn.Module, average: str | None = None) -> None:
        """Collective: write ``average`` into ``module`` (a plain model) on every rank, the same values
        everywhere (where ranks hold their own copy of a buffer, its owner's)."""
        export.copy_to(self._state, module, average)

    @_after_the_update
    def export(
        self,
        path: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        average: str | None = None,
        live: bool = False,
        writers: int | None = None,
    ) -> Path:
        """Collective: the full average as safetensors in the folder ``path`` (above ``max_shard_size``
        the Hugging Face sharded layout with its index). Every rank writes: its own parts where
        they lie in the files (parameters sharded in ranges: rows, flat shards), and about 1/W of
        the rest, received a bounded bucket at a time (``writers=k``: k ranks spread over the world
        receive everything; ``1``: rank 0 alone, for a file system that cannot take concurrent
        writers); the files are the same whatever the number. ``path`` must be a folder every writer sees.
        ``dtype`` casts floating tensors; ``live=True`` writes the live weights instead."""
        return export.export(self._state, path, max_shard_size, dtype, average, live, writers)

    @_after_the_update
    def state_dict(self) -> dict[str, Any]:
        """DCP Stateful: ``dcp.save({..., "ema": avg})`` (collective there). Each tensor in its own shape,
        this rank holding the boxes it owns, so ``dcp.load`` reshards to any layout or world size."""
        return stateful.state_dict(self._state)

    @_after_the_update
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore from ``state_dict()`` as ``dcp.load`` filled it: names and shapes must match; another
        rule raises unless ``strict=False``, which warns. Checked on every rank before anything changes."""
        stateful.load_state_dict(self._state, state_dict, strict)

    @_after_the_update
    def save(
        self, directory: str | os.PathLike, keep_last: int | None = None, dtype: torch.dtype | None = None
    ) -> Path:
        """Collective: an atomic sharded checkpoint of the averager alone (safetensors + JSON); with
        ``keep_last=K`` into ``directory/step-NNNNNNNNN``, the K newest kept. ``dtype`` stores the
        averaged tensors in that dtype."""
        return checkpoint.save(self._state, directory, keep_last, dtype)

    @_after_the_update
    def load(self, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
        """Collective: restore ``save``'s checkpoint (the newest of a ``keep_last`` directory) at any
        layout, one save whole even while another process saves there; ``verify`` hashes every
        file against its recorded SHA-256 first. Returns the checkpoint loaded."""
        return checkpoint.load(self._state, directory, strict, verify)

    def check_checkpoint(self, directory: str | os.PathLike, strict: bool = True, verify: bool = False) -> Path:
        """Collective: what ``load(directory, strict, verify)`` would refuse, refused now, with nothing
        changed: call it before an engine loads its own part of the same checkpoint, so that a
        damaged average never leaves the weights of one step beside the average of another."""
        return checkpoint.check(self._state, directory, strict, verify)

    def shadow_bytes(self) -> int:
        """Bytes of shadow storage on this rank."""
        return self._state.shadow_bytes()

    @_after_the_update
    def __repr__(self) -> str:
        return f"WeightAverager(rules={self.rules!r}, {self._state.summary()}, num_updates={self._state.num_updates})"
