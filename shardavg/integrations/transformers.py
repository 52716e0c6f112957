"""A weight average for the Hugging Face ``Trainer``, shard-local under DDP, FSDP and DeepSpeed.

``WeightAveragingCallback`` builds a ``WeightAverager`` once the Trainer has prepared the model
(``on_train_begin``: under DeepSpeed the ``model`` it is handed is the partitioned module, which
the averager reads through its ZeRO-3 adapter), updates it once per optimizer step
(``on_step_end``, after gradient accumulation), saves every rank's shard into
``checkpoint-<step>/shardavg/`` when the Trainer saves (``on_save`` runs on every rank after the
model, optimizer and ``trainer_state.json`` are written and old checkpoints rotated away, the
average with them), restores it when training resumes (the Trainer tells callbacks only the
restored ``global_step``: the checkpoint is ``output_dir/checkpoint-<global_step>``), and
exports the consolidated average at the end when asked. Bound to its Trainer
(``with_weight_averaging``), it also evaluates the averaged weights after each evaluation,
through ``swapped()``, and reports them as ``eval_avg_*`` next to the raw ``eval_*``.

It is deliberately not an ``ExportableState``: the Trainer would re-create such a callback from
JSON on resume, without its averager.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..averager import WeightAverager
from ..errors import CheckpointError
from ..rules import MultiAvgFn, Rule

DIRECTORY = "shardavg"  # inside each checkpoint-<step> folder
PREFIX = "eval_avg"  # metric prefix of the averaged weights' evaluation


class WeightAveragingCallback(TrainerCallback):
    """Keep ``rule``'s average of the model being trained (``averager_options`` go to ``WeightAverager``).

    Args:
        rule: e.g. ``EMA(decay=0.999)``; a dict of rules keeps several named averages (the
            first one is evaluated and exported).
        export_dir: where to write the consolidated average when training ends (safetensors,
            the model's own parameter names), or None.
    """

    def __init__(
        self, rule: Rule | MultiAvgFn | dict, export_dir: str | os.PathLike | None = None, **averager_options: Any
    ) -> None:
        self.rule = rule
        self.export_dir = None if export_dir is None else Path(export_dir)
        self.averager_options = averager_options
        self.averager: WeightAverager | None = None
        self._trainer: Any = None  # a weak reference, once bound
        self._evaluating = False

    def bind(self, trainer: Any) -> WeightAveragingCallback:
        """Let the callback evaluate the averaged weights with ``trainer`` (and add it there)."""
        self._trainer = weakref.ref(trainer)
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    @property
    def average(self) -> str | None:
        """The average evaluated and exported: the only one, or the first of several."""
        return next(iter(self.rule)) if isinstance(self.rule, dict) else None

    # ------------------------------------------------------------------ training

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.averager is None:
            self.averager = WeightAverager(model, self.rule, **self.averager_options)
        if state.global_step > 0:  # resumed: the Trainer restored this step's checkpoint
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / DIRECTORY
            if not path.is_dir():
                raise CheckpointError(
                    f"training resumes at step {state.global_step}, but {path} holds no average: resume from a "
                    f"checkpoint-<step> folder in output_dir ({args.output_dir}) that this callback saved"
                )
            self.averager.load(path)

    def on_step_end(self, args, state, control, **kwargs):
        self.averager.update(step=state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.averager.save(Path(args.output_dir) / f"checkpoint-{state.global_step}" / DIRECTORY)

    def on_train_end(self, args, state, control, **kwargs):
        if self.export_dir is not None and self.averager.num_updates:
            self.averager.export(self.export_dir, average=self.average)

    # ------------------------------------------------------------------ evaluation

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or self._evaluating or self.averager is None or not self.averager.num_updates:
            return
        self._evaluating = True
        try:
            with self.averager.swapped(self.average):
                averaged = trainer.evaluate(metric_key_prefix=PREFIX)
        finally:
            self._evaluating = False
        if metrics is not None:
            metrics.update(averaged)


def with_weight_averaging(trainer: Any, rule: Rule | MultiAvgFn | dict, **options: Any) -> WeightAveragingCallback:
    """Add a ``WeightAveragingCallback`` to ``trainer``, bound to it for ``eval_avg_*`` metrics."""
    return WeightAveragingCallback(rule, **options).bind(trainer)
