"""A DeepSpeed engine's checkpoint with the average inside it, committed by ``latest`` last.

DeepSpeed has no hook for extra per-rank files, and its ``save_checkpoint`` writes ``latest``
before its final barrier: a rank that dies after that leaves ``latest`` naming a tag whose
files are incomplete. ``save_checkpoint`` here asks the engine not to write ``latest``, writes
every rank's shard of the average into ``<save_dir>/<tag>/shardavg/`` (an atomic ``avg.save``),
waits for every rank, and only then replaces ``latest`` atomically. A crash at any moment
leaves ``latest`` naming the previous tag, whole. ``load_checkpoint`` follows ``latest`` (or
the tag given), refuses a tag without an average before the engine loads anything, and
restores both. A tag names one folder inside the save folder, the same on every rank: anything
else (``../x``, ``a/b``, ``''``, ``.``, ``latest``, surrounding spaces) is refused before a byte
is written.

``verdict(engine)`` is what the engine knows of its latest step, for ``avg.update(finite=...)``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from ..averager import WeightAverager
from ..base.dist import agree_or_raise, gather_or_raise, rank
from ..base.errors import CheckpointError
from ..checkpoints.storage import atomic_file
from . import Verdict, norm_verdict

AVERAGE_DIR = "shardavg"  # inside the tag's folder
LATEST = "latest"  # DeepSpeed's pointer to the newest tag


def verdict(engine: Any) -> Verdict:
    """The engine's verdict on its latest ``step()``, for ``avg.update(finite=verdict(engine))``.

    Nothing is read from the device: the norm is passed as the engine holds it.

    Args:
        engine: The ``DeepSpeedEngine``, just after ``engine.step()`` at a gradient accumulation
            boundary (between boundaries ``was_step_applied()`` is False: no update belongs there).

    Raises:
        ValueError: Called after a ``step()`` between boundaries (its micro-step count is not a
            multiple of ``gradient_accumulation_steps()``): a loop that updated the average after
            every micro-step would count each one as a skipped update.

    Returns:
        False when the step was not applied (an fp16 overflow, or a non-finite gradient norm
        ZeRO-3 and the bf16 optimizer found: the weights did not move, and the step must not
        enter the average); otherwise the global gradient norm (``get_global_grad_norm()``,
        whose finiteness is the verdict: kept by the fp16, bf16 and ZeRO optimizers); None where
        the engine keeps no norm (a plain torch optimizer without ZeRO, or ZeRO-1/2 with its norm
        turned off), and the averager's own screen runs.
    """
    accumulation = engine.gradient_accumulation_steps()
    if engine.micro_steps % accumulation != 0:
        raise ValueError(
            f"verdict(engine) after micro-step {engine.micro_steps}, between gradient accumulation boundaries "
            f"(every {accumulation} micro-steps): no optimizer step was taken, so no update belongs here; update "
            "the average only where engine.is_gradient_accumulation_boundary() was True before engine.step()"
        )
    if not engine.was_step_applied():
        return False
    return norm_verdict(engine.get_global_grad_norm())


def save_checkpoint(
    engine: Any,
    avg: WeightAverager,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    **kwargs: Any,
) -> Any:
    """Collective: ``engine.save_checkpoint`` and the average, then ``latest``.

    ``latest`` is written last, atomically, once every rank has committed: a crash at any moment
    leaves it naming the previous tag, whole.

    Args:
        engine: The ``DeepSpeedEngine``.
        avg: The averager, built on ``engine``.
        save_dir: The save folder, as for ``engine.save_checkpoint``.
        tag: The tag (one folder name, the same on every rank); None (default): DeepSpeed's
            ``global_step<N>``.
        client_state: Passed to the engine; None: ``{}``.
        save_latest: Point ``latest`` at the tag once everything is written.
        **kwargs: Passed to ``engine.save_checkpoint``.

    Returns:
        What ``engine.save_checkpoint`` returned.

    Raises:
        CheckpointError: ``tag`` does not name one folder inside the save folder (on some rank), the
            ranks name different tags, the average cannot be saved there, or ``latest`` cannot be
            written.

    Examples:
        A world of one process, made and torn down here; under torchrun every rank runs the lines
        between.

        >>> import os, socket, tempfile, torch, deepspeed, shardavg
        >>> with socket.socket() as probe:
        ...     _ = probe.bind(("127.0.0.1", 0))
        ...     port = str(probe.getsockname()[1])
        >>> world = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        >>> os.environ.update(world)
        >>> deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        >>> model = torch.nn.Linear(4, 2)
        >>> config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        ...           "zero_allow_untested_optimizer": True}
        >>> engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                   config=config)
        >>> avg = shardavg.WeightAverager(engine, shardavg.EMA(decay=0.9))
        >>> _ = avg.update()
        >>> folder = tempfile.mkdtemp()
        >>> _ = save_checkpoint(engine, avg, folder)  # the engine's files, the average, then `latest`
        >>> _ = load_checkpoint(engine, avg, folder)  # the average checked whole before the engine loads
        >>> avg.num_updates
        1
        >>> torch.distributed.destroy_process_group()
        >>> for key in world:
        ...     del os.environ[key]
    """
    tag = agreed_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    result = engine.save_checkpoint(
        str(save_dir), tag=tag, client_state={} if client_state is None else client_state, save_latest=False, **kwargs
    )
    avg.save(Path(save_dir) / tag / AVERAGE_DIR)  # committed on every rank when it returns
    error: BaseException | None = None
    if save_latest and rank() == 0:
        try:
            with atomic_file(Path(save_dir) / LATEST) as handle:
                handle.write(tag.encode())
        except Exception as caught:
            error = caught
    agree_or_raise(error, f"pointing {Path(save_dir) / LATEST} at {tag}")
    return result


def load_checkpoint(
    engine: Any,
    avg: WeightAverager,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    strict: bool = True,
    **kwargs: Any,
) -> Any:
    """Collective: ``engine.load_checkpoint`` and the average of the same tag.

    The average is checked whole on every rank (every file, names, shapes, rules) before the
    engine loads anything.

    Args:
        engine: The ``DeepSpeedEngine``.
        avg: The averager, built on ``engine``.
        load_dir: The save folder.
        tag: The tag to load; None (default): the one ``latest`` names.
        strict: Refuse a tag without an average (or an average of another rule); with False,
            warn, and restart a missing average from the loaded live weights (as if its first
            update had just copied them).
        **kwargs: Passed to ``engine.load_checkpoint``.

    Returns:
        What ``engine.load_checkpoint`` returned.

    Raises:
        CheckpointError: No readable ``latest``, a tag that does not name one folder inside the
            save folder, ranks naming different tags, (under ``strict``) a tag without an average,
            or an average the averager refuses.
    """
    error: BaseException | None = None
    path = Path(load_dir)
    try:
        tag = _tag(Path(load_dir), tag)
        path = Path(load_dir) / tag / AVERAGE_DIR
        if not path.is_dir() and strict:
            raise CheckpointError(
                f"{Path(load_dir) / tag} holds no average ({AVERAGE_DIR}/ is missing: saved by the engine's own "
                "save_checkpoint?); pass strict=False to load the engine and restart the average from its weights"
            )
    except Exception as caught:
        error = caught
    tags = gather_or_raise(error, tag, f"loading {load_dir}")
    if len(set(tags)) > 1:
        raise CheckpointError(f"the ranks name different tags {tags}: every rank must load the same tag")
    if path.is_dir():
        avg.check_checkpoint(path, strict=strict)  # the whole average, before the engine moves
    result = engine.load_checkpoint(str(load_dir), tag=tag, **kwargs)
    if path.is_dir():
        avg.load(path, strict=strict)
    else:
        warnings.warn(f"{path.parent} holds no average: restarted from the loaded weights", stacklevel=2)
        avg.restart(engine.global_steps)
    return result


def _tag(load_dir: Path, tag: str | None) -> str:
    if tag is not None:
        return check_tag(tag)
    try:
        latest = (load_dir / LATEST).read_text().strip()
    except OSError as error:
        raise CheckpointError(f"{load_dir} has no readable {LATEST!r} file: pass tag=") from error
    try:
        return check_tag(latest)
    except ValueError:
        raise CheckpointError(f"{load_dir / LATEST} names {latest!r}, not a tag") from None


def check_tag(tag: object) -> str:
    """``tag`` as DeepSpeed spells it, checked to name one folder inside the save folder.

    Args:
        tag: A tag (DeepSpeed uses ``str(tag)``).

    Returns:
        ``str(tag)``, which ``latest`` can point at and be read back from.

    Raises:
        ValueError: Empty, ``.``, ``..``, ``latest``, with a separator, surrounding spaces or control
            characters.
    """
    text = str(tag)
    if (
        text in ("", ".", "..", LATEST)
        or text != text.strip()
        or any(separator in text for separator in {"/", os.sep, os.altsep or "/"})
        or any(ord(character) < 32 for character in text)
    ):
        raise ValueError(
            f"tag {text!r} does not name one folder inside the save folder: use a plain name (no '/', not '.', "
            f"'..', '' or {LATEST!r}, no surrounding spaces or control characters), e.g. 'global_step100'"
        )
    return text


def agreed_tag(tag: object) -> str:
    """Collective: ``check_tag`` on every rank, and the same tag on all of them.

    Otherwise every rank would write its files into another folder.

    Args:
        tag: This rank's tag.

    Returns:
        The tag, the same on every rank.

    Raises:
        CheckpointError: ``check_tag`` refused the tag on some rank (every rank raises, naming it),
            or the ranks name different tags.
    """
    error: BaseException | None = None
    try:
        tag = check_tag(tag)
    except ValueError as caught:
        error = caught
    tags = gather_or_raise(error, str(tag), "checking the checkpoint tag")
    if len(set(tags)) > 1:
        raise CheckpointError(f"the ranks name different tags {tags}: every rank must save under the same tag")
    return tags[0]
