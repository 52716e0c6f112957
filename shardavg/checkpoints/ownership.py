"""What shardavg may delete or replace, and the lock that keeps two writers of one path apart.

The rule: shardavg deletes or replaces only what it can prove it wrote. A checkpoint
folder is its own when it holds a ``shardavg.json`` manifest and nothing but shardavg's
files (by name); a staging folder (``.NAME.incomplete``) when it holds the staging marker
or a manifest, and nothing else (a model folder's weight files: ``output.target``). Anything
else in the way is the user's: the write is refused, naming it, and nothing is touched. Nothing
is written inside a checkpoint but the checkpoint itself, and no target is an empty path or a
bare ``.``/``..``.

A save or an export holds an exclusive ``flock`` on a lock file of its target from its first
file to its commit, so a second writer is refused at once instead of interleaving its files
with the first one's. The lock file is created without following links, holds a line that
proves it is shardavg's, and is reused (a holder that died) or removed (on release) only then:
a link or someone's file at its name is refused, never truncated or deleted. The kernel drops
the lock when its holder dies.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
import time
import warnings
from pathlib import Path
from typing import Any

from ..base.errors import CheckpointError
from .format import CHECKPOINT_FILE, MANIFEST
from .storage import INCOMPLETE

STAGING_MARKER = ".shardavg-staging"
LOCK_FILE = ".shardavg.lock"  # a writer's lock inside the folder it writes


def temporary_of(name: str, pattern: re.Pattern) -> bool:
    """Whether ``name`` is ``.<own file>.incomplete``: a file an atomic write left behind."""
    return name.startswith(".") and name.endswith(INCOMPLETE) and bool(pattern.match(name[1 : -len(INCOMPLETE)]))


def entries_of(path: Path) -> dict[str, os.stat_result] | None:
    """The entries of a real folder (not a link) by name, or None."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        return {entry.name: entry.stat(follow_symlinks=False) for entry in os.scandir(path)}
    except FileNotFoundError:
        return None


def _only_own_files(entries: dict[str, os.stat_result], extra: tuple[str, ...] = ()) -> bool:
    return all(
        stat.S_ISREG(st.st_mode)
        and (CHECKPOINT_FILE.match(name) or temporary_of(name, CHECKPOINT_FILE) or name in extra)
        for name, st in entries.items()
    )


def foreign_in_checkpoint(path: Path) -> list[str]:
    """What in the folder ``path`` shardavg did not write as a checkpoint (empty: it may be replaced)."""
    entries = entries_of(path) or {}
    foreign = sorted(
        name
        for name, st in entries.items()
        if not (stat.S_ISREG(st.st_mode) and (CHECKPOINT_FILE.match(name) or temporary_of(name, CHECKPOINT_FILE)))
    )
    if entries and MANIFEST not in entries and not foreign:
        foreign = ["(no shardavg.json: not a committed checkpoint)"]
    return foreign


def is_own_checkpoint(path: Path) -> bool:
    entries = entries_of(path)
    return entries is not None and MANIFEST in entries and _only_own_files(entries)


def is_own_staging(path: Path) -> bool:
    """A staging folder a save left: the marker (before commit) or a manifest (the previous
    checkpoint, swapped out by the commit), and nothing but shardavg's files."""
    entries = entries_of(path)
    return (
        entries is not None
        and (STAGING_MARKER in entries or MANIFEST in entries)
        and _only_own_files(entries, extra=(STAGING_MARKER,))
    )


def target_path(path: str | os.PathLike, what: str, replaced_whole: bool) -> Path:
    """``path`` as a folder shardavg writes into: never an empty path (which would silently mean
    the current folder), and, when it is replaced whole, one with a name of its own."""
    text = os.fspath(path)
    if not text:
        raise ValueError(f"{what}: the path is empty; name a folder, e.g. 'ckpt/ema'")
    target = Path(text)
    if replaced_whole and target.name in ("", ".", ".."):
        raise ValueError(
            f"{what}: {text!r} names the current or a parent folder, which shardavg would have to replace "
            "as a whole; name a folder of its own inside it, e.g. 'ckpt/ema'"
        )
    return target


def enclosing_checkpoint(path: Path) -> Path | None:
    """The shardavg checkpoint (or post-hoc snapshot) that ``path`` is or lies inside, if any:
    anything else written there would make it foreign to the saves that replace or prune it."""
    for folder in (path.resolve(), *path.resolve().parents):
        if (folder / MANIFEST).is_file():
            return folder
    return None


LOCK_RECORD = re.compile(r"^shardavg lock: (pid \d+ on \S+)\n?$")
LOCK_WAIT = 2.0  # seconds a fresh lock file may stay empty while its creator takes it


class TargetLock:
    """An exclusive, non-blocking lock on a target shardavg writes: a second writer is refused at once.

    Use it as a context manager: entering takes the lock, leaving releases it and removes the
    lock file. ``inside(directory)`` locks ``directory/.shardavg.lock`` (a ``keep_last``
    folder, an export folder: places shardavg writes into); ``beside(target)`` locks
    ``.NAME.lock`` next to a single checkpoint, which is swapped whole and so cannot hold its own
    lock. Any other ``path`` works the same (the main job locks its run folder for its lifetime).
    Where the platform or file system has no ``flock``, entering warns and locks nothing.

    Args:
        path: The lock file (created, with its parent folders, on entering).
        target: What the lock protects, named in messages.

    Raises:
        CheckpointError: On entering: another process holds the lock, or something shardavg did
            not write (a link, another file, a folder) is at ``path``.
    """

    def __init__(self, path: Path, target: Path) -> None:
        self.path, self.target = Path(path), Path(target)
        self._fd: int | None = None

    @classmethod
    def inside(cls, directory: Path) -> TargetLock:
        """The lock of a folder shardavg writes into, kept inside it.

        Args:
            directory: The folder.

        Returns:
            A lock on ``directory/.shardavg.lock`` (not taken yet).
        """
        return cls(directory / LOCK_FILE, directory)

    @classmethod
    def beside(cls, target: Path) -> TargetLock:
        """The lock of a target replaced whole (a single checkpoint), kept next to it.

        Args:
            target: The target.

        Returns:
            A lock on ``.NAME.lock`` beside ``target`` (not taken yet).
        """
        return cls(target.with_name(f".{target.name}.lock"), target)

    def __enter__(self) -> TargetLock:
        try:
            import fcntl
        except ImportError:  # not POSIX
            warnings.warn(f"cannot lock {self.target} here: concurrent writers are not detected", stacklevel=2)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            fd, created = self._open()
            try:
                self._flock(fcntl, fd, created, deadline)
            except OSError as error:  # a file system without flock
                os.close(fd)
                warnings.warn(f"cannot lock {self.path} ({error}): concurrent writers are not detected", stacklevel=2)
                return self
            if not self._still_at_path(fd):  # its holder removed it while we waited: lock the new one
                os.close(fd)
                continue
            record = os.pread(fd, 200, 0).decode(errors="replace")
            if created or LOCK_RECORD.match(record):
                break
            os.close(fd)
            if record or time.monotonic() >= deadline:  # someone's file, or empty for too long to be a fresh lock
                raise CheckpointError(
                    f"{self.path} is in the way of {self.target}'s lock and was not written by shardavg "
                    f"({'holds ' + repr(record[:40]) if record else 'an empty file'}): shardavg will neither "
                    "overwrite nor delete it; move it"
                )
            time.sleep(0.01)  # a lock file its creator has not written yet
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"shardavg lock: pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def _flock(self, fcntl: Any, fd: int, created: bool, deadline: float) -> None:
        """Take the lock on ``fd``, or refuse naming its holder. A file this call created may be
        held for a moment by another process checking it; the wait for that is bounded."""
        while True:
            try:
                return fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not (created and time.monotonic() < deadline):
                    os.close(fd)
                    raise CheckpointError(
                        f"{self.target} is being written by another process ({self._holder()}, holding "
                        f"{self.path}); two jobs must not save or export into the same place"
                    ) from None
                time.sleep(0.01)

    def _open(self) -> tuple[int, bool]:
        """A descriptor of the lock file and whether this call created it; a link or anything but a
        regular file at the path is refused."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                pass
            try:
                fd = os.open(self.path, flags)
            except FileNotFoundError:
                continue  # released between the two opens
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise
                raise CheckpointError(
                    f"{self.path} is a link, where shardavg keeps {self.target}'s lock: shardavg will not write "
                    "through it; remove the link"
                ) from None
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd, False
            os.close(fd)
            raise CheckpointError(f"{self.path} is in the way of {self.target}'s lock and is not a regular file")

    def _still_at_path(self, fd: int) -> bool:
        try:
            here, mine = os.lstat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def _holder(self) -> str:
        """Who holds the lock, from its record (a holder still creating it has written none yet)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return "unknown"
        try:
            match = LOCK_RECORD.match(os.pread(fd, 200, 0).decode(errors="replace"))
        finally:
            os.close(fd)
        return match.group(1) if match else "unknown"

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        if self._still_at_path(self._fd):  # only the file this lock made or proved its own
            os.unlink(self.path)  # while still holding it, so no one locks a removed file
        os.close(self._fd)
        self._fd = None
