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
from pathlib import Path
from typing import Any

from ..averager import WeightAverager

DIRECTORY = "shardavg"  # inside the accelerator's checkpoint folder

# accelerator -> {directory: (averager, save hook handle, check)}: a second attach is refused, load_state checks
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(accelerator: Any, avg: WeightAverager, directory: str = DIRECTORY) -> tuple[Any, Any]:
    """Save and load ``avg`` with ``accelerator.save_state``/``load_state`` under ``<dir>/<directory>``.

    Returns the two hook handles (``handle.remove()`` detaches). Attaching the same averager
    twice, or another one to the same directory, is refused. Update the averager once per real
    optimizer step: ``if accelerator.sync_gradients: avg.update()`` after ``optimizer.step()``.
    """
    if not directory or os.sep in directory or directory in (".", ".."):
        raise ValueError(f"directory must be a plain folder name inside the checkpoint, got {directory!r}")
    live = _live(accelerator)
    for name, (other, _, _) in live.items():
        if other is avg:
            raise ValueError(f"this averager is already attached to the accelerator (under {name!r})")
        if name == directory:
            raise ValueError(f"another averager is attached under {directory!r}: pass directory= another name")

    def save(models: list, weights: list, output_dir: str | os.PathLike) -> None:
        avg.save(Path(output_dir) / directory)

    def load(models: list, input_dir: str | os.PathLike) -> None:
        avg.load(Path(input_dir) / directory)

    def check(input_dir: str | os.PathLike) -> None:
        avg.check_checkpoint(Path(input_dir) / directory)

    save_handle = accelerator.register_save_state_pre_hook(save)
    load_handle = accelerator.register_load_state_pre_hook(load)
    live[directory] = (avg, save_handle, check)
    _ATTACHED[accelerator] = live
    return save_handle, load_handle


def load_state(accelerator: Any, input_dir: str | os.PathLike, **kwargs: Any) -> Any:
    """Collective: check every average attached to ``accelerator`` in ``input_dir`` (every file, names,
    shapes, rules), then ``accelerator.load_state(input_dir, **kwargs)``: a damaged average is
    refused before the model or the optimizer changes."""
    for _, _, check in _live(accelerator).values():
        check(input_dir)
    return accelerator.load_state(str(input_dir), **kwargs)


def _live(accelerator: Any) -> dict:
    """The registrations on ``accelerator`` whose hooks were not removed since."""
    return {
        name: registration
        for name, registration in _ATTACHED.get(accelerator, {}).items()
        if registration[1].id in getattr(accelerator, "_save_model_state_pre_hook", {registration[1].id: None})
    }
