"""A Lightning callback that averages weights shard-local under DDP, FSDP, ModelParallel and DeepSpeed.

Lightning's own ``WeightAveraging`` deep-copies the module into an ``AveragedModel`` and pairs
parameters by position: under FSDP and DeepSpeed ZeRO-3 that copy holds the shards, or
nothing. ``ShardedWeightAveraging`` takes the arguments users know from
``EMAWeightAveraging`` and keeps a ``WeightAverager`` on the strategy's model instead: built in
``on_fit_start`` (after the strategy has sharded the model), updated once per new
``global_step``, swapped in for validation (and swapped back at its end, or on an exception),
and optionally copied into the model when training ends. When it updates is asked of
``should_update(step_idx=..., epoch_idx=...)`` as Lightning's ``WeightAveraging`` asks it: after
each optimizer step and at each training epoch's end, so a subclass written for Lightning's
callback (its SWA recipe updates once an epoch) keeps its schedule.

Checkpoints: a callback's own state is saved from rank 0 only under FSDP and ModelParallel,
and a callback cannot add to their distributed checkpoint. So every rank's shard goes to a
sidecar folder next to each checkpoint, ``<checkpoint>.shardavg/``, written whenever the
strategy writes the checkpoint (saving the same path again replaces it) and removed with it;
``trainer.fit(ckpt_path=...)`` restores it from beside that path. With
``checkpoint_weights="average"`` the checkpoint's own ``state_dict`` is the average, as with
Lightning's callback (``load_from_checkpoint`` gives the averaged model; a distributed checkpoint
holds the average's shards where the model's would be): the strategy saves inside ``swapped()``,
and the live weights, which a resume needs, go to a second sidecar, ``<checkpoint>.shardavg-live/``
(a ``torch.distributed.checkpoint`` of this rank's shards, written by every rank).

Each update is handed the verdict Lightning already has on the step (``update(finite=...)``): a
step the ``GradScaler`` skipped (seen as an optimizer whose ``step()`` never ran: torch's step
hooks) is never averaged nor counted; otherwise the norm Lightning clipped with
(``gradient_clip_val``), the engine's verdict under DeepSpeed, or nothing (and the averager's
screen runs). See ``StepWatch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import shutil
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ..averager import WeightAverager, checked_options
from ..base.errors import CheckpointError
from ..checkpoints.ownership import is_own_checkpoint
from ..rules import EMA, MultiAvgFn, Rule
from . import Verdict, deepspeed, norm_verdict

SUFFIX = ".shardavg"  # the sidecar of checkpoint PATH is PATH.shardavg/
LIVE_SUFFIX = ".shardavg-live"  # the live weights of a checkpoint whose state_dict is the average
HOLDS = "shardavg_state_dict"  # the checkpoint's key saying what its state_dict holds: "average"
CheckpointWeights = Literal["live", "average"]


def sidecar(checkpoint: str | Path) -> Path:
    """Where the average of the checkpoint at ``checkpoint`` is kept.

    Args:
        checkpoint: The path of a Lightning checkpoint.

    Returns:
        ``<checkpoint>.shardavg``, beside it.
    """
    path = Path(checkpoint)
    return path.with_name(path.name + SUFFIX)


def live_sidecar(checkpoint: str | Path) -> Path:
    """Where the live weights of a checkpoint saved with ``checkpoint_weights="average"`` are kept.

    Args:
        checkpoint: The path of a Lightning checkpoint.

    Returns:
        ``<checkpoint>.shardavg-live``, beside it.
    """
    path = Path(checkpoint)
    return path.with_name(path.name + LIVE_SUFFIX)


def save_live(model: nn.Module, path: Path) -> None:
    """Collective: the model's weights as a ``torch.distributed.checkpoint`` at ``path``, each rank its shards.

    torch's state-dict API names the tensors alike under DDP, FSDP and FSDP2 and keeps them
    sharded, so no rank gathers the model.
    """
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)


def load_live(model: nn.Module, path: Path) -> None:
    """Collective: load what ``save_live`` wrote at ``path`` back into ``model``, each rank its shards."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


class ShardedWeightAveraging(Callback):
    """EMA (or any shardavg rule) of the weights, kept shard by shard where the strategy keeps them.

    Args:
        decay: The EMA decay, as in Lightning's ``EMAWeightAveraging`` (ignored when ``rule`` is given).
        rule: Any shardavg rule (``SWA()``, ``PowerEMA(...)``, a ``multi_avg_fn``) instead; None
            (default): ``EMA(decay=decay)``.
        update_every_n_steps: Update after optimizer step ``i`` (counted from 0) when
            ``i % update_every_n_steps == 0`` (and ``i >= update_starting_at_step``), as
            ``EMAWeightAveraging`` does; 0: never after a step (epoch updates only).
        update_starting_at_step: The first optimizer step (from 0) that updates; None: the first.
        update_starting_at_epoch: Also update at the end of each training epoch from this one (from
            0) on, as ``EMAWeightAveraging`` does; None (default): no epoch updates.
        copy_at_end: Write the average into the model when training ends.
        strict: On resume, refuse a checkpoint without its sidecar average (or, saved with
            ``checkpoint_weights="average"``, without its live weights); with False, warn and go
            on instead: the average restarted from the loaded weights (training from the average).
        validate_original_weights: Validate the live weights, as NeMo's EMA callback does with the
            same name; False (default): validate the average.
        checkpoint_weights: What a checkpoint's ``state_dict`` holds: ``"live"`` (default), the
            live weights, the average beside them in ``<checkpoint>.shardavg/``; ``"average"``, the
            average, as Lightning's own callback saves it (``load_from_checkpoint`` gives the
            averaged model), the live weights in ``<checkpoint>.shardavg-live/`` for resuming. Not
            under ``DeepSpeedStrategy``, which restores the weights from its optimizer's partitions.
        **averager_options: Passed to ``WeightAverager``: its ``strategy``, ``source``, ``pipeline`` and
            [`Options`][shardavg.update.options.Options], checked here.

    Attributes:
        averager: The ``WeightAverager``, once ``on_fit_start`` has built it (None before).

    Raises:
        ValueError: ``update_every_n_steps`` is negative, ``checkpoint_weights`` is neither
            ``"live"`` nor ``"average"``, or an option out of its range.
        TypeError: A keyword that is neither ``WeightAverager``'s nor an option.

    Examples:
        A tiny model in one process; with a strategy, every rank runs the same lines.

        >>> import torch
        >>> import lightning as L
        >>> class Tiny(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(4, 1)
        ...     def training_step(self, batch, index):
        ...         return self.layer(batch[0]).pow(2).mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> averaging = ShardedWeightAveraging(decay=0.9)
        >>> trainer = L.Trainer(max_steps=3, callbacks=[averaging], accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4)
        >>> trainer.fit(Tiny(), data)
        >>> averaging.averager.num_updates
        3
    """

    def __init__(
        self,
        decay: float = 0.999,
        rule: Rule | MultiAvgFn | None = None,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        copy_at_end: bool = False,
        strict: bool = True,
        validate_original_weights: bool = False,
        checkpoint_weights: CheckpointWeights = "live",
        **averager_options: Any,
    ) -> None:
        if update_every_n_steps < 0:
            raise ValueError(f"update_every_n_steps must be >= 0, got {update_every_n_steps}")
        if checkpoint_weights not in ("live", "average"):
            raise ValueError(f'checkpoint_weights must be "live" or "average", got {checkpoint_weights!r}')
        self.rule = EMA(decay=decay) if rule is None else rule
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch
        self.copy_at_end = copy_at_end
        self.strict = strict
        self.validate_original_weights = validate_original_weights
        self.checkpoint_weights = checkpoint_weights
        checked_options(averager_options)  # refused here, not when training begins
        self.averager_options = averager_options
        self.averager: WeightAverager | None = None
        self._swap: contextlib.ExitStack | None = None
        self._resume_from: Resume | None = None  # until restored
        self._wrapped: tuple[Any, Any, Any] | None = None  # (strategy, save_checkpoint, remove_checkpoint)
        self._steps: StepWatch | None = None  # while fitting
        self._seen_step = -1  # the global step whose verdict was taken last

    # ------------------------------------------------------------------ building and updating

    def on_fit_start(self, trainer, pl_module) -> None:
        """Build the averager on the strategy's (sharded) model, follow its checkpoints, restore a pending resume.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.

        Raises:
            ValueError: ``checkpoint_weights="average"`` under ``DeepSpeedStrategy``.
            CheckpointError: Resuming (``strict``) from a checkpoint without its sidecar average, or
                one the averager refuses to load.
        """
        if self.checkpoint_weights == "average" and isinstance(trainer.strategy, DeepSpeedStrategy):
            raise ValueError(
                'checkpoint_weights="average" is not available under DeepSpeedStrategy: DeepSpeed restores the '
                "weights from its optimizer's fp32 partitions, so its checkpoint cannot hold the average; keep "
                'checkpoint_weights="live" and export the average (averager.export) for a model that loads as it'
            )
        if self.averager is None:
            self.averager = WeightAverager(trainer.strategy.model, self.rule, **self.averager_options)
        self._follow_checkpoints(trainer.strategy)
        if self._steps is None:
            self._steps = StepWatch(trainer)
        self._restore_pending()

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update after optimizer step ``step_idx`` or at the end of epoch ``epoch_idx``.

        Asked as Lightning's ``WeightAveraging`` asks it, one of the two given: ``step_idx`` after
        each optimizer step, ``epoch_idx`` at each training epoch's end, both counted from 0. So a
        schedule written for Lightning's callback runs here unchanged: override this method, e.g.
        its SWA recipe ``return epoch_idx is not None and epoch_idx >= 10``. Not asked where the
        step just taken is averaged already: at the end of an epoch whose last step updated (where
        Lightning's callback would average the same weights twice), nor again after a resume.

        Args:
            step_idx: The optimizer step just taken, or None at an epoch's end.
            epoch_idx: The training epoch just ended, or None after a step.

        Returns:
            As ``EMAWeightAveraging`` decides: after a step, whether ``step_idx`` is at or after
                ``update_starting_at_step`` and a multiple of ``update_every_n_steps`` (never with
                0); at an epoch's end, whether ``epoch_idx`` is at or after
                ``update_starting_at_epoch`` (never with None).
        """
        every, first_step = self.update_every_n_steps, self.update_starting_at_step
        first_epoch = self.update_starting_at_epoch
        by_step = step_idx is not None and every > 0 and step_idx % every == 0
        by_step = by_step and (first_step is None or step_idx >= first_step)
        by_epoch = epoch_idx is not None and first_epoch is not None and epoch_idx >= first_epoch
        return by_step or by_epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Update once per new ``global_step`` (so once per real optimizer step under accumulation),
        with the verdict on that step.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
            outputs (Any): Unused.
            batch (Any): Unused.
            batch_idx (int): Unused.
        """
        step = trainer.global_step  # optimizer steps so far: a new one after each real step (even one skipped)
        if step == self._seen_step:
            return
        self._seen_step = step
        finite = self._steps.verdict()  # taken at every new step, so none is left for a later one
        if step > self.averager.step and self.should_update(step_idx=step - 1):
            self.averager.update(step=step, finite=finite)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Update at the end of a training epoch when ``should_update(epoch_idx=...)`` says so.

        The update is at the epoch's last step; its verdict was taken with that step, so the
        averager's screen runs instead.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
        """
        step = trainer.global_step
        if not _takes_epochs(self.should_update):  # (an override written for 0.12's should_update(step_idx))
            return
        if step > self.averager.step and self.should_update(epoch_idx=trainer.current_epoch):
            self.averager.update(step=step)

    def on_train_end(self, trainer, pl_module) -> None:
        """Write the average into the model, with ``copy_at_end`` and once it has updates.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
        """
        if self.copy_at_end and self.averager.num_updates:
            self.averager.copy_into_model()

    # ------------------------------------------------------------------ validation with the average

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        """Swap the average in for validation (not during the sanity check, nor before an update,
        nor with ``validate_original_weights``).

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
        """
        if self.validate_original_weights or trainer.sanity_checking:
            return
        if self.averager is not None and self.averager.num_updates:
            self._swap = contextlib.ExitStack()
            self._swap.enter_context(self.averager.swapped())

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """Swap the live weights back after validation.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
        """
        self._swap_back()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Swap the live weights back if an exception interrupted validation.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
            exception: The exception raised.
        """
        self._swap_back()

    def _swap_back(self) -> None:
        if self._swap is not None:
            swap, self._swap = self._swap, None
            swap.close()

    # ------------------------------------------------------------------ checkpoints

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Restore the average (and, where the checkpoint holds the average, the live weights) from
        beside ``trainer.ckpt_path``, now or once the averager is built.

        Lightning runs this after the strategy has loaded the checkpoint's ``state_dict`` into the
        model, and before training goes on.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
            checkpoint: The loaded checkpoint (its ``global_step`` is what ``strict=False`` restarts at;
                its ``shardavg_state_dict`` says whether its ``state_dict`` is the average).

        Raises:
            CheckpointError: Under ``strict``, the checkpoint has no sidecar (or no live weights
                beside an average), or the averager refuses it.
        """
        # before or after on_fit_start, as the strategy restores
        step = int(checkpoint.get("global_step", trainer.global_step))
        self._resume_from = Resume(trainer.ckpt_path, step, checkpoint.get(HOLDS) == "average", trainer.strategy)
        self._restore_pending()

    def _restore_pending(self) -> None:
        if self.averager is None or self._resume_from is None:
            return
        resume, self._resume_from = self._resume_from, None
        checkpoint, path = resume.checkpoint, sidecar(resume.checkpoint)
        if path.exists() or self.strict:
            if not path.exists():
                raise CheckpointError(
                    f"{checkpoint} has no average beside it: copy its sidecar {path.name}/ along with it, or pass "
                    "ShardedWeightAveraging(strict=False) to restart the average from the loaded weights"
                )
            self.averager.load(path)
        else:
            warnings.warn(f"{checkpoint} has no average beside it ({path.name}/): restarted from the loaded "
                          "weights", stacklevel=2)  # fmt: skip
            self.averager.restart(resume.step)
        if resume.holds_average:
            self._restore_live(resume)

    def _restore_live(self, resume: Resume) -> None:
        """The model was loaded with the average the checkpoint holds: load the live weights saved beside it."""
        path = live_sidecar(resume.checkpoint)
        if path.is_dir():
            load_live(resume.strategy.model, path)
            return
        if self.strict:
            raise CheckpointError(
                f"{resume.checkpoint} holds the average as its state_dict, and its live weights are not beside "
                f"it: copy its sidecar {path.name}/ along with it, or pass ShardedWeightAveraging(strict=False) "
                "to go on training from the average"
            )
        warnings.warn(f"{resume.checkpoint} holds the average and no live weights beside it ({path.name}/): "
                      "training goes on from the average", stacklevel=3)  # fmt: skip

    def _follow_checkpoints(self, strategy) -> None:
        """Write the sidecars whenever the strategy writes a checkpoint, remove them with it."""
        if self._wrapped is not None and self._wrapped[0] is strategy:
            return
        save, remove = strategy.save_checkpoint, strategy.remove_checkpoint

        def save_checkpoint(checkpoint: dict, filepath, *args: Any, **kwargs: Any) -> None:
            if self.checkpoint_weights == "average" and self.averager.num_updates:
                save_live(strategy.model, live_sidecar(filepath))  # before the swap: the live weights
                checkpoint[HOLDS] = "average"
                with self.averager.swapped():  # the strategy writes the average in the model's place
                    checkpoint["state_dict"] = strategy.lightning_module_state_dict()
                    save(checkpoint, filepath, *args, **kwargs)
            else:
                save(checkpoint, filepath, *args, **kwargs)
            self.averager.save(sidecar(filepath))  # collective: every rank's shard

        def remove_checkpoint(filepath) -> None:
            remove(filepath)
            path, live = sidecar(filepath), live_sidecar(filepath)
            if strategy.is_global_zero and is_own_checkpoint(path):
                shutil.rmtree(path)
            if strategy.is_global_zero and live.is_dir():
                shutil.rmtree(live)

        strategy.save_checkpoint, strategy.remove_checkpoint = save_checkpoint, remove_checkpoint
        self._wrapped = (strategy, save, remove)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Swap back if still swapped, and give the strategy its own checkpoint methods back.

        Args:
            trainer (lightning.pytorch.Trainer): The trainer.
            pl_module (lightning.pytorch.LightningModule): The module being trained.
            stage: The stage ending (``"fit"``, ``"validate"``, ...).
        """
        self._swap_back()
        if self._steps is not None:
            self._steps.close()
            self._steps = None
        if self._wrapped is not None:
            strategy, save, remove = self._wrapped
            strategy.save_checkpoint, strategy.remove_checkpoint = save, remove
            self._wrapped = None


@dataclasses.dataclass(frozen=True)
class Resume:
    """A checkpoint ``trainer.fit(ckpt_path=...)`` loaded, whose average is still to be restored.

    Attributes:
        checkpoint: Its path.
        step: Its global step (where ``strict=False`` restarts the average).
        holds_average: Its ``state_dict`` is the average (``checkpoint_weights="average"``): the
            live weights are to be loaded from beside it.
        strategy (lightning.pytorch.strategies.Strategy): The strategy whose model it was loaded into.
    """

    checkpoint: str
    step: int
    holds_average: bool
    strategy: Any


class StepWatch:
    """What Lightning knows of each optimizer step, gathered while fitting, for ``update(finite=...)``.

    A ``GradScaler`` that finds a non-finite gradient skips ``optimizer.step()`` while Lightning
    still counts the step, and the callback hooks run before its check or after its state is
    cleared; torch's public step hooks (``register_step_post_hook``) see whether ``step()`` ran.
    Lightning clips (``gradient_clip_val``, ``"norm"``) with ``clip_grad_norm_`` and drops the norm
    it returns: its own ``Precision.clip_grad_by_norm`` is replaced, on this trainer's plugin only,
    by the same two lines keeping that norm (a plugin with a method of its own is left alone).
    Under DeepSpeed the engine steps and keeps its own verdict.

    Args:
        trainer (lightning.pytorch.Trainer): The trainer, once its strategy holds the optimizers.
    """

    def __init__(self, trainer) -> None:
        self._engine = trainer.strategy.model if hasattr(trainer.strategy.model, "was_step_applied") else None
        self._plugin = trainer.precision_plugin
        self._stepped = False
        self._norm: torch.Tensor | None = None
        self._hooks = []
        if self._engine is None:
            self._hooks = [optimizer.register_step_post_hook(self._step_ran) for optimizer in trainer.optimizers]
        if type(self._plugin).clip_grad_by_norm is Precision.clip_grad_by_norm:
            self._plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _step_ran(self, *_: Any) -> None:
        self._stepped = True

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """``Precision.clip_grad_by_norm``, keeping the norm."""
        self._norm = torch.nn.utils.clip_grad_norm_(self._plugin.main_params(optimizer), clip_val)

    def verdict(self) -> Verdict:
        """The verdict on the optimizer steps since the last one taken (and forget them).

        Returns:
            Under DeepSpeed, the engine's (``integrations.deepspeed.verdict``). Otherwise False when
                no optimizer's ``step()`` ran (the ``GradScaler`` skipped it); the norm clipped with
                (a tensor, as ``clip_grad_norm_`` returned it); else None (no verdict: the screen
                runs). An optimizer that unscales inside its step (fused AdamW) is always called by
                the ``GradScaler``, which skips inside it: only the norm tells such a skip.
        """
        if self._engine is not None:
            return deepspeed.verdict(self._engine)
        stepped, norm, self._stepped, self._norm = self._stepped, self._norm, False, None
        if not stepped:
            return False
        return norm_verdict(norm)

    def close(self) -> None:
        """Remove the step hooks and give the plugin its own ``clip_grad_by_norm`` back."""
        for hook in self._hooks:
            hook.remove()
        self._plugin.__dict__.pop("clip_grad_by_norm", None)


def _takes_epochs(should_update: Any) -> bool:
    """Whether an override of ``should_update`` takes ``epoch_idx``: one written for 0.12's
    ``should_update(step_idx)`` is asked after optimizer steps only, as it was then."""
    parameters = inspect.signature(should_update).parameters.values()
    return any(p.name == "epoch_idx" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
