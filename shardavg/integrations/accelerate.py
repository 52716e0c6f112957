"""``accelerator.save_state(dir)`` and ``load_state(dir)`` carrying every rank's shard of an average.

``attach`` registers accelerate's state hooks. The save hook runs on every rank once the model
and optimizer are written (DeepSpeed's and FSDP's included) and writes ``dir/shardavg/`` with
``avg.save``, which is atomic and has committed on every rank when it returns (``save_state``
itself ends without a barrier). The load hook restores it with ``avg.load``, at any world size
the checkpoint can be read at. The averager is held here, because accelerate gives the load
hook no models under FSDP and DeepSpeed. That hook runs after the model and optimizer are
loaded, so a damaged average would be found only then, beside weights already at the
checkpoint's step: ``load_state(accelerator, dir)`` checks every attached average first and
only then calls ``accelerator.load_state(dir)``. (``register_for_checkpointing`` would pickle rank 0's
state only, and unpickle it with ``weights_only=False``: never used.)

``verdict(accelerator)`` is what accelerate knows of the latest optimizer step, for
``avg.update(finite=...)``: a step it skipped, the norm ``accelerator.clip_grad_norm_`` returned
(kept by ``attach``, which wraps that method on the accelerator: accelerate keeps no norm of its
own; under its DeepSpeed plugin the method returns the engine's norm).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..averager import WeightAverager
from . import Verdict, norm_verdict

FOLDER = "shardavg"  # inside the accelerator's checkpoint folder

# accelerator -> {directory: Registration}: a second attach is refused, load_state checks each
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# accelerator -> [the norm its clip_grad_norm_ returned last, until verdict() takes it]
_NORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Registration:
    """An averager attached to an accelerator, and how to check its checkpoint before a load.

    Attributes:
        averager: The attached averager.
        check: Checks the average inside a checkpoint folder (raising ``CheckpointError``).
    """

    averager: WeightAverager
    check: Callable[[str | os.PathLike], None]


class Handle:
    """One of accelerate's hook handles, kept: ``remove()`` also detaches the averager here.

    Args:
        handle: The handle accelerate's ``register_*_state_pre_hook`` returned.
        registrations: The accelerator's attached averagers, by folder.
        directory: The folder the averager is attached under.
    """

    def __init__(self, handle: Any, registrations: dict, directory: str) -> None:
        self.handle, self._registrations, self._folder = handle, registrations, directory

    def remove(self) -> None:
        """Remove the hook and detach the averager, so that it (or another) can be attached again."""
        self.handle.remove()
        self._registrations.pop(self._folder, None)


def attach(accelerator: Any, avg: WeightAverager, directory: str = FOLDER) -> tuple[Handle, Handle]:
    """Save and load ``avg`` with ``accelerator.save_state``/``load_state`` under ``<dir>/<directory>``.

    Update the averager once per real optimizer step: ``if accelerator.sync_gradients:
    avg.update(finite=verdict(accelerator))`` after ``optimizer.step()``. Load with this module's
    ``load_state``, which checks the average before anything is loaded. From here on the norms
    ``accelerator.clip_grad_norm_`` returns are kept for ``verdict`` (``keep_norms``).

    Args:
        accelerator: The ``accelerate.Accelerator``.
        avg: The averager, built on the model ``accelerator.prepare`` returned.
        directory: The folder name inside each checkpoint; default ``"shardavg"``.

    Returns:
        The save and load hook handles (``remove()`` either to detach).

    Raises:
        ValueError: ``directory`` is not a plain folder name, this averager is already attached, or
            another one is attached under ``directory``.

    Examples:
        One process; under ``accelerate launch`` or torchrun every rank runs the same lines.

        >>> import tempfile, torch, shardavg
        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True)
        >>> model = torch.nn.Linear(4, 2)
        >>> model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> avg = shardavg.WeightAverager(model, shardavg.EMA(decay=0.9))
        >>> handles = attach(accelerator, avg)
        >>> _ = avg.update()
        >>> folder = tempfile.mkdtemp()
        >>> _ = accelerator.save_state(folder)  # writes folder/shardavg/ too
        >>> _ = load_state(accelerator, folder)  # checks the average first, then loads everything
        >>> avg.num_updates
        1
    """
    if not directory or os.sep in directory or directory in (".", ".."):
        raise ValueError(f"directory must be a plain folder name inside the checkpoint, got {directory!r}")
    registrations = _ATTACHED.setdefault(accelerator, {})
    for name, registration in registrations.items():
        if registration.averager is avg:
            raise ValueError(f"this averager is already attached to the accelerator (under {name!r})")
        if name == directory:
            raise ValueError(f"another averager is attached under {directory!r}: pass directory= another name")

    def save(models: list, weights: list, output_dir: str | os.PathLike) -> None:
        avg.save(Path(output_dir) / directory)

    def load(models: list, input_dir: str | os.PathLike) -> None:
        avg.load(Path(input_dir) / directory)

    def check(input_dir: str | os.PathLike) -> None:
        avg.check_checkpoint(Path(input_dir) / directory)

    registrations[directory] = Registration(avg, check)
    keep_norms(accelerator)
    return (
        Handle(accelerator.register_save_state_pre_hook(save), registrations, directory),
        Handle(accelerator.register_load_state_pre_hook(load), registrations, directory),
    )


def load_state(accelerator: Any, input_dir: str | os.PathLike, **kwargs: Any) -> Any:
    """Collective: check every attached average, then ``accelerator.load_state(input_dir, **kwargs)``.

    Each average is checked in ``input_dir`` (every file, names, shapes, rules) first, so a damaged
    one is refused before the model or the optimizer changes.

    Args:
        accelerator: The ``accelerate.Accelerator`` the averagers are attached to.
        input_dir: The checkpoint folder ``save_state`` wrote.
        **kwargs: Passed to ``accelerator.load_state``.

    Returns:
        What ``accelerator.load_state`` returned.

    Raises:
        CheckpointError: An attached average is missing or damaged there.
    """
    for registration in list(_ATTACHED.get(accelerator, {}).values()):
        registration.check(input_dir)
    return accelerator.load_state(str(input_dir), **kwargs)


def keep_norms(accelerator: Any) -> None:
    """Keep the norm each ``accelerator.clip_grad_norm_`` returns, for the next ``verdict``.

    accelerate hands the norm to the caller and keeps nothing, so the method is wrapped on this
    accelerator (once; the Trainer's is wrapped by ``transformers.with_weight_averaging``). The
    norm is kept as returned: a tensor stays on its device.

    Args:
        accelerator: The ``accelerate.Accelerator``.
    """
    if accelerator in _NORMS:
        return
    kept = _NORMS[accelerator] = [None]
    clip = accelerator.clip_grad_norm_

    @functools.wraps(clip)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        kept[0] = clip(*args, **kwargs)
        return kept[0]

    accelerator.clip_grad_norm_ = clip_grad_norm_


def verdict(accelerator: Any) -> Verdict:
    """accelerate's verdict on the latest optimizer step, for ``avg.update(finite=verdict(accelerator))``.

    Take it once per step (it takes the kept norm, so that a norm is never trusted for a later
    step that did not clip) and pass it to every averager updated at that step.

    Args:
        accelerator: The ``accelerate.Accelerator``, after ``optimizer.step()`` with
            ``accelerator.sync_gradients``.

    Returns:
        False when accelerate skipped the step (``optimizer_step_was_skipped``: its ``GradScaler``
        found a non-finite gradient, or DeepSpeed's fp16 overflow); otherwise the norm the latest
        ``accelerator.clip_grad_norm_`` returned since the last verdict (with ``keep_norms``, which
        ``attach`` calls; under the DeepSpeed plugin, the engine's norm as a float); else None (no
        verdict: the averager's screen runs). A step not reported skipped is no verdict of its
        own: with an optimizer that unscales inside its step (fused AdamW), the ``GradScaler``
        always calls ``step()`` and accelerate reports no skip at all; clip to have the norm.
    """
    kept = _NORMS.get(accelerator, [None])
    norm, kept[0] = kept[0], None
    if accelerator.optimizer_step_was_skipped:
        return False
    return norm_verdict(norm)
