"""What shardavg may delete or replace, and the lock that keeps two writers of one path apart.

The rule: shardavg deletes or replaces only what it can prove it wrote. A checkpoint
directory is its own when it holds a ``shardavg.json`` manifest and nothing but shardavg's
files (by name); a staging directory (``.NAME.incomplete``) when it holds the staging marker
or a manifest, and nothing else; an exported weight file when its safetensors metadata
carries shardavg's entry. Anything else in the way is the user's: the write is refused,
naming it, and nothing is touched.

A save or an export holds an exclusive ``flock`` on a lock file of its target from its first
file to its commit, so a second writer is refused at once instead of interleaving its files
with the first one's. The kernel drops the lock when its holder dies; the file is removed on
release.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import warnings
from pathlib import Path

from .errors import CheckpointError
from .storage import safetensors_metadata

MANIFEST = "shardavg.json"
STAGING_MARKER = ".shardavg-staging"
CHECKPOINT_FILE = re.compile(r"^(shardavg\.json|rank-\d{5}-of-\d{5}\.safetensors)$")
EXPORT_FILE = re.compile(r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$")
INDEX_FILE = "model.safetensors.index.json"


def _temporary_of(name: str, pattern: re.Pattern) -> bool:
    """Whether ``name`` is ``.<own file>.incomplete``: a file an atomic write left behind."""
    return name.startswith(".") and name.endswith(".incomplete") and bool(pattern.match(name[1 : -len(".incomplete")]))


def _entries(path: Path) -> dict[str, os.stat_result] | None:
    """The entries of a real directory (not a link) by name, or None."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        return {entry.name: entry.stat(follow_symlinks=False) for entry in os.scandir(path)}
    except FileNotFoundError:
        return None


def _only_own_files(entries: dict[str, os.stat_result], extra: tuple[str, ...] = ()) -> bool:
    return all(
        stat.S_ISREG(st.st_mode)
        and (CHECKPOINT_FILE.match(name) or _temporary_of(name, CHECKPOINT_FILE) or name in extra)
        for name, st in entries.items()
    )


def foreign_in_checkpoint(path: Path) -> list[str]:
    """What in the directory ``path`` shardavg did not write as a checkpoint (empty: it may be replaced)."""
    entries = _entries(path) or {}
    foreign = sorted(
        name
        for name, st in entries.items()
        if not (stat.S_ISREG(st.st_mode) and (CHECKPOINT_FILE.match(name) or _temporary_of(name, CHECKPOINT_FILE)))
    )
    if entries and MANIFEST not in entries and not foreign:
        foreign = ["(no shardavg.json: not a committed checkpoint)"]
    return foreign


def is_own_checkpoint(path: Path) -> bool:
    entries = _entries(path)
    return entries is not None and MANIFEST in entries and _only_own_files(entries)


def is_own_staging(path: Path) -> bool:
    """A staging directory a save left: the marker (before commit) or a manifest (the previous
    checkpoint, swapped out by the commit), and nothing but shardavg's files."""
    entries = _entries(path)
    return (
        entries is not None
        and (STAGING_MARKER in entries or MANIFEST in entries)
        and _only_own_files(entries, extra=(STAGING_MARKER,))
    )


def is_own_export_file(path: Path) -> bool:
    """An exported weight file or index that carries shardavg's metadata."""
    try:
        if path.name == INDEX_FILE:
            index = json.loads(path.read_text())
            metadata = index.get("metadata") if isinstance(index, dict) else None
            return isinstance(metadata, dict) and "shardavg" in metadata
        return "shardavg" in safetensors_metadata(path)
    except Exception:  # unreadable, foreign or truncated: not provably ours
        return False


def export_files(path: Path) -> dict[str, bool]:
    """The weight files in the directory ``path``, each with whether shardavg wrote it."""
    entries = _entries(path) or {}
    return {
        # an atomic write's leftover is ours by its name; a weight file by its metadata
        name: stat.S_ISREG(st.st_mode) and (temporary or is_own_export_file(path / name))
        for name, st in entries.items()
        if (temporary := _temporary_of(name, EXPORT_FILE)) or EXPORT_FILE.match(name)
    }


class TargetLock:
    """Exclusive, non-blocking: refuses at once when another process is writing ``target``.

    ``inside(directory)`` locks ``directory/.shardavg.lock`` (a ``keep_last`` directory, an
    export folder: places shardavg writes into); ``beside(target)`` locks ``.NAME.lock`` next to
    a single checkpoint, which is swapped whole and so cannot hold its own lock.
    """

    def __init__(self, path: Path, target: Path) -> None:
        self.path, self.target = path, target
        self._fd: int | None = None

    @classmethod
    def inside(cls, directory: Path) -> TargetLock:
        return cls(directory / ".shardavg.lock", directory)

    @classmethod
    def beside(cls, target: Path) -> TargetLock:
        return cls(target.with_name(f".{target.name}.lock"), target)

    def __enter__(self) -> TargetLock:
        try:
            import fcntl
        except ImportError:  # not POSIX
            warnings.warn(f"cannot lock {self.target} here: concurrent writers are not detected", stacklevel=2)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise CheckpointError(
                    f"{self.target} is being written by another process ({holder}, holding {self.path}); "
                    "two jobs must not save or export into the same place"
                ) from None
            except OSError as error:  # a file system without flock
                os.close(fd)
                warnings.warn(f"cannot lock {self.path} ({error}): concurrent writers are not detected", stacklevel=2)
                return self
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break  # the lock file we hold is still the one at the path
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder removed it while we waited: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding it, so no one locks a removed file
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
