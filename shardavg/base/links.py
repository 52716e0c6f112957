"""Where a file of a checkpoint someone else wrote really lies: the one link confinement check.

A checkpoint folder a user downloaded is hostile until checked: a link inside it
(``common.pt -> /etc/passwd``, ``zero/w/fp32.pt -> ~/other-run/...``) would read another file
into a merge, or carry it into a folder its user then publishes. Every reader of another tool's
files (Megatron, DeepSpeed, DCP, torchtitan, Hugging Face, an averager's save) asks ``confined``
for the real path of each file it opens or carries, so one rule holds everywhere: a link is
followed only while it stays within the input (or, for a snapshot of the Hugging Face cache, its
repository's ``blobs/``, where the cache keeps the files its snapshots link to). ``own_file`` adds
what a reader needs before it opens one: a regular file (a FIFO would block the read). The input
the user names may itself be a link, and so may the folders above it: the user chose it.

What shardavg writes is never reached through a link at the name given (``refuse_linked_target``):
a save swaps a new folder into that name, which would replace the link and leave the folder it
points to as it was, and an export's checks and lock see the name, not where it leads. The user
chose the link, so the refusal says where it points: that real folder is what to pass.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from .errors import CheckpointError

HUB_REPOSITORY = re.compile(r"^(models|datasets|spaces)--.")  # the Hugging Face cache's folder of one repository


def confined(file: Path, folder: Path) -> Path:
    """The real path of ``file``, a file (or folder) of the input ``folder``, every link followed;
    refused in one line naming both unless it lies within the folder or, for a snapshot of the
    Hugging Face cache (``models--ORG--NAME/snapshots/REV/``, or a folder within one), its
    repository's ``blobs/``."""
    try:
        real, home = file.resolve(strict=True), folder.resolve(strict=True)
    except (OSError, RuntimeError) as error:  # (a missing target, a loop of links)
        raise CheckpointError(f"cannot follow the links of {file}: {error}") from None
    trees = [home]
    for revision in (home, *home.parents):
        if revision.parent.name == "snapshots" and HUB_REPOSITORY.match(revision.parent.parent.name):
            trees.append(revision.parent.parent / "blobs")
            break
    if not any(real.is_relative_to(tree) for tree in trees):
        within = f"{folder}" + (f" or {trees[1]}" if len(trees) > 1 else "")
        raise CheckpointError(
            f"{file} links to {real}, outside {within}: shardavg reads and carries only a checkpoint's own files; "
            "copy the file into the folder if it belongs to the checkpoint"
        )
    return real


def own_file(file: Path, folder: Path, refused: str) -> Path:
    """The real path of ``file`` of the input ``folder``, the one a reader opens: a regular file
    (never a FIFO, whose open blocks, or a device), reached through a link only where ``confined``
    finds it stays within the folder; ``refused`` says what a missing one means for the input
    (``"not a DCP checkpoint"``)."""
    real = confined(file, folder) if os.path.lexists(file) else file
    try:
        regular = stat.S_ISREG(os.lstat(real).st_mode)
    except OSError:
        regular = False
    if not regular:
        raise CheckpointError(f"{file} is missing or not a regular file: {refused}")
    return real


def refuse_linked_target(target: Path, error: type[CheckpointError]) -> None:
    """Refuse ``target``, a folder shardavg is to write (a save's, OUT), where it is a symbolic link,
    raising ``error`` in one line naming where it points and the real folder to pass instead (a
    link to a file: a folder to name instead)."""
    if not target.is_symlink():
        return
    real = Path(os.path.realpath(target))  # (never raises: a dangling link or a loop gives a path)
    fix = "name a folder instead" if real.exists() and not real.is_dir() else f"pass the real folder, {real}, instead"
    raise error(f"{target} is a symbolic link to {real}: shardavg does not write through a link; {fix}")
