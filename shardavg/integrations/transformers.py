"""A weight average for the Hugging Face ``Trainer``, shard-local under DDP, FSDP and DeepSpeed.

``WeightAveragingCallback`` builds a ``WeightAverager`` once the Trainer has prepared the model
(``on_train_begin``: under DeepSpeed the ``model`` it is handed is the partitioned module, which
the averager reads through its ZeRO-3 strategy), updates it once per optimizer step
(``on_step_end``, after gradient accumulation), saves every rank's shard into
``checkpoint-<step>/shardavg/`` when the Trainer saves (``on_save`` runs on every rank after the
model, optimizer and ``trainer_state.json`` are written and old checkpoints rotated away, the
average with them), and exports the consolidated average, with the model's ``config.json``, at
the end when asked (with ``load_best_model_at_end``, the average saved with the best checkpoint).

Every average is saved paired with its checkpoint: its ``run_id`` is the SHA-256 of the
``trainer_state.json`` beside it (a fingerprint, 32 hex digits). On resume it is loaded from the
checkpoint the Trainer actually resumed (``with_weight_averaging`` sees the argument of
``trainer.train``; an unbound callback can only look in ``output_dir/checkpoint-<global_step>``)
and refused unless that pairing holds, so an average is never paired with other weights.

The Trainer saves and rotates checkpoints on the process it takes for process zero. Where accelerate
counts the processes wrongly (DeepSpeed on a machine without GPUs: every rank is "process zero"),
every rank rotates ``output_dir`` at once, and one rank's deletion in progress makes that folder the
newest by mtime to another, which then deletes a checkpoint ``save_total_limit`` keeps (seen under
load, when a step's checkpoints lie over a second apart and the Trainer orders them by mtime). With
``save_on_each_node`` every rank is then the process zero of its node, and the ranks of one machine
rotate its ``output_dir`` alike. The callback finds that at the start of training and refuses it
under ``save_total_limit``, saying how to set accelerate up (``_check_one_process_saves``).

Bound to its Trainer (``with_weight_averaging``), it also evaluates the averaged weights after
each evaluation, through ``swapped()``, and reports them as ``eval_avg_*`` next to the raw ``eval_*``
(not with ``validate_original_weights=True``: the live weights alone, as NeMo's EMA callback says it).

Each update is handed the verdict the Trainer already has on the step (``update(finite=...)``). A
callback is given neither the gradient norm (a local of the training loop, logged as a float only
at logging steps, after ``on_step_end``) nor the skip, but ``on_step_end`` sees the optimizer, whose
``step_was_skipped`` says whether accelerate's ``GradScaler`` skipped the step: such a step is never
averaged nor counted. Bound, it takes accelerate's verdict from the Trainer's accelerator
(``integrations.accelerate.verdict``), which also holds the norm the Trainer clipped with (it takes
every norm through ``accelerator.clip_grad_norm_``; the mixed-mesh norm of tensor parallel does not,
and gives none) and DeepSpeed's verdict.
It is deliberately not an ``ExportableState``: the Trainer would re-create such a callback from
JSON on resume, without its averager.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import warnings
import weakref
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..averager import WeightAverager, checked_options
from ..base.dist import all_gathered, distributed, rank, world_size
from ..base.errors import CheckpointError
from ..base.untrusted import parse_json
from ..checkpoints.reading import read_manifest, resolve
from ..output.model_folder import declare_dtype
from ..rules import MultiAvgFn, Rule
from . import Verdict, accelerate

FOLDER = "shardavg"  # inside each checkpoint-<step> folder
TRAINER_STATE = "trainer_state.json"  # the Trainer's file the average is paired with
PREFIX = "eval_avg"  # metric prefix of the averaged weights' evaluation


class WeightAveragingCallback(TrainerCallback):
    """Keep ``rule``'s average of the model being trained, saved with every checkpoint.

    Add it with ``with_weight_averaging``, which also binds it to its Trainer.

    Args:
        rule: E.g. ``EMA(decay=0.999)``; a dict of rules keeps several named averages (the
            first one is evaluated and exported).
        export_dir: Where to write the consolidated average when training ends (safetensors,
            the model's own parameter names, and its ``config.json``: ``from_pretrained`` loads
            it); None (default): no export.
        strict: On resume, refuse a checkpoint without an average paired with it; with False,
            warn and restart the average from the loaded weights instead.
        validate_original_weights: Evaluate the live weights only, as NeMo's EMA callback does with
            the same name (the Trainer's ``eval_*`` are always the live weights'); False (default):
            also evaluate the average, reported as ``eval_avg_*``.
        **averager_options: Passed to ``WeightAverager``: its ``strategy``, ``source``, ``pipeline`` and
            [`Options`][shardavg.update.options.Options], checked here.

    Attributes:
        averager: The ``WeightAverager``, once ``on_train_begin`` has built it (None before).

    Raises:
        ValueError: An option out of its range.
        TypeError: A keyword that is neither ``WeightAverager``'s nor an option.
    """

    def __init__(
        self,
        rule: Rule | MultiAvgFn | dict,
        export_dir: str | os.PathLike | None = None,
        strict: bool = True,
        validate_original_weights: bool = False,
        **averager_options: Any,
    ) -> None:
        self.rule = rule
        self.export_dir = None if export_dir is None else Path(export_dir)
        self.strict = strict
        self.validate_original_weights = validate_original_weights
        checked_options(averager_options)  # refused here, not when training begins
        self.averager_options = averager_options
        self.averager: WeightAverager | None = None
        self._trainer: Any = None  # a weak reference, once bound
        self._resumed_from: Path | None = None  # the checkpoint ``trainer.train`` resumed, once bound
        self._evaluating = False
        self._warned_unbound = False

    def bind(self, trainer: Any) -> WeightAveragingCallback:
        """Add the callback to ``trainer`` (if not there yet) and bind it there.

        Bound, it evaluates the averaged weights with ``trainer`` and sees which checkpoint
        ``trainer.train(resume_from_checkpoint=...)`` resumes.

        Args:
            trainer: The ``transformers.Trainer``.

        Returns:
            The callback itself.
        """
        self._trainer = weakref.ref(trainer)
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        train = trainer.train

        @functools.wraps(train)
        def train_seen(*args: Any, **kwargs: Any) -> Any:
            self._resumed_from = _resumed_checkpoint(trainer, kwargs.get("resume_from_checkpoint", None))
            return train(*args, **kwargs)

        trainer.train = train_seen
        return self

    @property
    def average(self) -> str | None:
        """The average evaluated and exported: the only one, or the first of several."""
        return next(iter(self.rule)) if isinstance(self.rule, dict) else None

    # ------------------------------------------------------------------ training

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Build the averager on the prepared model; on resume, load the average paired with the checkpoint.

        Args:
            args (transformers.TrainingArguments): The Trainer's arguments.
            state (transformers.TrainerState): The Trainer's state.
            control (transformers.TrainerControl): Unused.
            model (torch.nn.Module): The model as the Trainer prepared it (partitioned under DeepSpeed).
            **kwargs (Any): The Trainer's other callback arguments; unused.

        Raises:
            CheckpointError: On resume, the checkpoint has no average (under ``strict``), its average
                was saved with other weights, or it is not the checkpoint the Trainer resumed; or
                more than one process would rotate checkpoints under ``save_total_limit``.
        """
        _check_one_process_saves(args)
        trainer = self._bound()
        if trainer is not None:
            accelerate.keep_norms(trainer.accelerator)  # (the Trainer may make a new one before training)
        if self.averager is None:
            self.averager = WeightAverager(model, self.rule, **self.averager_options)
        if state.global_step > 0:  # resumed: the Trainer restored a checkpoint of this step
            checkpoint = self._resumed_from
            if checkpoint is None:  # unbound: the checkpoint of that step in output_dir, if it is the one
                checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                _check_resumed(checkpoint, state)
            self._restore(checkpoint, state.global_step)

    def _restore(self, checkpoint: Path, step: int) -> None:
        """Load the average saved with ``checkpoint``, checked to be paired with it; or, with
        ``strict=False`` and none there, restart it from the loaded weights."""
        path = checkpoint / FOLDER
        if not path.is_dir():
            if not self.strict:
                warnings.warn(f"{checkpoint} holds no average: restarted from the loaded weights", stacklevel=3)
                self.averager.restart(step)
                return
            raise CheckpointError(
                f"training resumes from {checkpoint} at step {step}, but it holds no average ({FOLDER}/): copy "
                f"it with the checkpoint, add the callback with with_weight_averaging(trainer, ...) so it sees "
                "which checkpoint resumes, or pass strict=False to restart the average from the loaded weights"
            )
        saved = read_manifest(resolve(path))
        paired = saved.run
        if paired is None:  # saved before averages were paired with their checkpoint
            warnings.warn(f"{path} records no pairing with {checkpoint}: loaded on trust", stacklevel=3)
        elif (saved.step, paired) != (step, _fingerprint(checkpoint)):
            raise CheckpointError(
                f"{path} was not saved with {checkpoint} (its average is of step {saved.step} and paired with "
                f"another {TRAINER_STATE}): the weights and the average would not belong together"
            )
        self.averager.load(path)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        """Update the average at ``state.global_step`` (once per optimizer step), with the verdict on it.

        Args:
            args (transformers.TrainingArguments): The Trainer's arguments.
            state (transformers.TrainerState): The Trainer's state.
            control (transformers.TrainerControl): Unused.
            optimizer (accelerate.optimizer.AcceleratedOptimizer): The Trainer's optimizer.
            **kwargs (Any): The Trainer's other callback arguments; unused.
        """
        self.averager.update(step=state.global_step, finite=self._verdict(optimizer))

    def _verdict(self, optimizer: Any) -> Verdict:
        """Bound: accelerate's verdict (the skip, the norm clipped with); unbound: the skip alone."""
        trainer = self._bound()
        if trainer is not None:
            return accelerate.verdict(trainer.accelerator)
        return False if getattr(optimizer, "step_was_skipped", False) else None

    def _bound(self) -> Any:
        """The Trainer bound to, while it lives; None when unbound."""
        return self._trainer() if self._trainer is not None else None

    def on_save(self, args, state, control, **kwargs):
        """Save every rank's shard into ``checkpoint-<step>/shardavg/``, paired with the checkpoint.

        Args:
            args (transformers.TrainingArguments): The Trainer's arguments.
            state (transformers.TrainerState): The Trainer's state.
            control (transformers.TrainerControl): Unused.
            **kwargs (Any): The Trainer's other callback arguments; unused.
        """
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.averager.run_id = _fingerprint(checkpoint)  # (the Trainer wrote the state before calling)
        self.averager.save(checkpoint / FOLDER)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        """Export the average to ``export_dir``, with the model's configs, when one is set.

        With ``load_best_model_at_end``, the average saved with the best checkpoint is exported.

        Args:
            args (transformers.TrainingArguments): The Trainer's arguments.
            state (transformers.TrainerState): The Trainer's state.
            control (transformers.TrainerControl): Unused.
            model (torch.nn.Module): The trained model (its ``config`` and ``generation_config`` are
                written beside the weights).
            **kwargs (Any): The Trainer's other callback arguments; unused.
        """
        if self.export_dir is None or not self.averager.num_updates:
            return
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best is not None and (Path(best) / FOLDER).is_dir():
            self.averager.load(Path(best) / FOLDER)  # the average saved with the model the Trainer kept
        self.averager.export(self.export_dir, average=self.average)
        if rank() == 0:  # the rank that wrote the weights (the Trainer may call more than one process zero)
            for part in ("config", "generation_config"):  # what from_pretrained needs beside the weights
                if hasattr(getattr(model, part, None), "save_pretrained"):
                    getattr(model, part).save_pretrained(self.export_dir)
            declare_dtype(Path(self.export_dir))  # the average's dtype (fp32 of a bf16 model), not the model's

    # ------------------------------------------------------------------ evaluation

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Evaluate the averaged weights too (bound callbacks only, not with ``validate_original_weights``)
        and add them as ``eval_avg_*``.

        Args:
            args (transformers.TrainingArguments): The Trainer's arguments.
            state (transformers.TrainerState): The Trainer's state.
            control (transformers.TrainerControl): Unused.
            metrics (dict): The evaluation's metrics, extended in place.
            **kwargs (Any): The Trainer's other callback arguments; unused.
        """
        if self.validate_original_weights:
            return
        trainer = self._bound()
        if trainer is None and not self._warned_unbound:
            self._warned_unbound = True
            warnings.warn(
                "WeightAveragingCallback sees an evaluation but is not bound to its Trainer: eval_avg_* metrics "
                "need it added with with_weight_averaging(trainer, ...)",
                stacklevel=2,
            )
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


def _check_one_process_saves(args: Any) -> None:
    """Collective: refuse (under ``save_total_limit``) or warn when more than one process would save
    checkpoints where one is expected (one in all; one per node with ``save_on_each_node``), every
    rank alike.

    The Trainer writes a checkpoint's files and rotates ``output_dir`` on each process whose
    ``args.should_save`` is true: process zero, or with ``save_on_each_node`` each node's local
    process zero. Where accelerate counts the processes wrongly (DeepSpeed without GPUs: each rank
    is process 0 of 1, and local process 0 of its node), several processes rotate one folder at once:
    ``shutil.rmtree`` of the oldest folder in one process updates that folder's mtime, another
    process's ``rotate_checkpoints(use_mtime=True)`` then takes it for the newest and deletes a
    checkpoint the limit keeps (only when the folders' mtimes span over a second, as under load).
    Checking once, before training, is what makes it never happen; every rank raises alike, so none
    waits on a peer that left.

    A node is a host name: every process of one machine has it whatever launched them, where the
    launchers' variables differ (torchrun's ``GROUP_RANK``, MPI's, none under a hand-made group), and
    accelerate's own local index is the count that went wrong. (Two machines of one run that share a
    name would count as one node, and one saver on each be refused.)
    """
    if not distributed():
        return
    node = socket.gethostname() if args.save_on_each_node else ""  # "": the whole group is one "node"
    savers: dict[str, list[int]] = {}
    for r, (host, saves) in enumerate(all_gathered((node, bool(args.should_save)))):
        if saves:
            savers.setdefault(host, []).append(r)
    crowded = {host: ranks for host, ranks in savers.items() if len(ranks) > 1}
    if not crowded:
        return
    counted = f"it counts {args.world_size} process(es), as accelerate does under DeepSpeed on a machine without GPUs"
    if args.save_on_each_node:
        where = " and ".join(f"ranks {ranks} on host {host}" for host, ranks in crowded.items())
        why = (
            f"{where} (of {world_size()}) each take themselves for the Trainer's process zero of their node "
            f"(save_on_each_node=True expects one per node; {counted})"
        )
    else:
        why = f"ranks {crowded['']} of {world_size()} each take themselves for the Trainer's process zero ({counted})"
    fix = (
        'set accelerate up first: os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"; '
        'accelerate.PartialState(backend="gloo"); then TrainingArguments(..., '
        'accelerator_config={"use_configured_state": True})'
    )
    if args.save_total_limit is not None and args.save_total_limit > 0:
        raise CheckpointError(
            f"{why}, so each rotates the checkpoints in {args.output_dir} at once, and one can delete a "
            f"checkpoint save_total_limit={args.save_total_limit} keeps: {fix}"
        )
    warnings.warn(f"{why}, so each writes the same checkpoint files in {args.output_dir} at once: {fix}", stacklevel=3)


def _fingerprint(checkpoint: Path) -> str | None:
    """The pairing of an average with its checkpoint: the SHA-256 of its ``trainer_state.json``."""
    try:
        return hashlib.sha256((checkpoint / TRAINER_STATE).read_bytes()).hexdigest()[:32]
    except FileNotFoundError:
        return None


def _check_resumed(checkpoint: Path, state: Any) -> None:
    """The Trainer restored ``state`` from the checkpoint it resumed: the history in ``checkpoint``'s
    own state must be that one, or it is another run's checkpoint at the same step."""
    try:
        history = parse_json((checkpoint / TRAINER_STATE).read_text(), checkpoint / TRAINER_STATE).get("log_history")
    except (OSError, ValueError, AttributeError):
        return  # none to compare: _restore refuses or restarts on what it finds
    if history != state.log_history:
        raise CheckpointError(
            f"{checkpoint} is not the checkpoint the Trainer resumed (its history differs: another run's, at the "
            "same step?): add the callback with with_weight_averaging(trainer, ...) so it loads the average of "
            "the checkpoint actually resumed"
        )


def _resumed_checkpoint(trainer: Any, resume: Any) -> Path | None:
    """The checkpoint ``trainer.train(resume_from_checkpoint=resume)`` restores, as the Trainer finds it."""
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(trainer.args.output_dir)
        return None if last is None else Path(last)
    return None if resume in (None, False) else Path(resume)


def with_weight_averaging(trainer: Any, rule: Rule | MultiAvgFn | dict, **options: Any) -> WeightAveragingCallback:
    """Add a ``WeightAveragingCallback`` to ``trainer``, bound to it.

    Bound, it reports ``eval_avg_*`` metrics and sees which checkpoint ``trainer.train`` resumes.

    Args:
        trainer: The ``transformers.Trainer``.
        rule: E.g. ``EMA(decay=0.999)``, or a dict of rules (see ``WeightAveragingCallback``).
        **options: ``WeightAveragingCallback``'s other arguments (``export_dir``, ``strict``,
            ``validate_original_weights``) and ``WeightAverager``'s options.

    Returns:
        The callback added.

    Examples:
        A tiny model in one process; under torchrun every rank runs the same lines.

        >>> import tempfile, torch, shardavg
        >>> from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2))
        >>> data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 8
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=4,
        ...                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
        >>> trainer = Trainer(model=model, args=args, train_dataset=data)
        >>> averaging = with_weight_averaging(trainer, shardavg.EMA(decay=0.9))
        >>> _ = trainer.train()  # the Trainer prints its summary
        {'train_runtime': ..., 'train_loss': ..., 'epoch': ...}
        >>> averaging.averager.num_updates
        3
    """
    return WeightAveragingCallback(rule, **options).bind(trainer)
