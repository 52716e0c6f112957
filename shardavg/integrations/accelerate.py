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
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..averager import WeightAverager

DIRECTORY = "shardavg"  # inside the accelerator's checkpoint folder

# accelerator -> {directory: Registration}: a second attach is refused, load_state checks each
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
        registrations: The accelerator's attached averagers, by directory.
        directory: The directory the averager is attached under.
    """

    def __init__(self, handle: Any, registrations: dict, directory: str) -> None:
        self.handle, self._registrations, self._directory = handle, registrations, directory

    def remove(self) -> None:
        """Remove the hook and detach the averager, so that it (or another) can be attached again."""
        self.handle.remove()
        self._registrations.pop(self._directory, None)


def attach(accelerator: Any, avg: WeightAverager, directory: str = DIRECTORY) -> tuple[Handle, Handle]:
    """Save and load ``avg`` with ``accelerator.save_state``/``load_state`` under ``<dir>/<directory>``.

    Update the averager once per real optimizer step: ``if accelerator.sync_gradients:
    avg.update()`` after ``optimizer.step()``. Load with this module's ``load_state``, which checks
    the average before anything is loaded.

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
