"""Reading a committed checkpoint as one save, whatever another process does to its folder meanwhile.

A save commits by swapping a complete folder into place (``storage.commit_folder``) and
removing the previous one, and ``keep_last`` prunes old ones. A reader that looked its files up
by path could take the manifest of one save and a shard of the next. ``OpenCheckpoint`` opens
the checkpoint's folder once and every file through that handle, so everything it reads
comes from the folder it opened; a later save swaps in another folder and cannot change
it. If the opened folder is replaced or removed before one of its files is opened, the
reader says so (``CheckpointReplaced``) and ``open_checkpoint`` opens the newer save instead,
a bounded number of times. Within a save, each shard names the save it belongs to (an id the
manifest holds too), and the manifest records every file's size and SHA-256: sizes and ids are
checked whenever a file is opened, the hashes by ``verify``.

Links: the checkpoint named may be one (``ckpt/latest -> step-00000100``, a folder on another
disk), and so may the folders above it: the user chose it. Within it, nothing leaves: the newest
``step-*`` of a folder of saves lies within that folder, and a save's files are opened through
its folder's handle, never through a link (shardavg writes none, and a relative one could lead
into another save); a link among them is refused naming where it leads (``links.confined``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from pathlib import Path

from ..base.errors import CheckpointError
from ..base.links import confined
from ..base.validate import is_count
from .description import Description
from .format import MANIFEST, SAVE_ID_KEY, STEP_DIR, parse_manifest, read_manifest_bytes
from .ownership import is_own_checkpoint
from .storage import SafetensorsFile, replaced_path

ATTEMPTS = 10  # newer saves a reader follows before it gives up


class CheckpointReplaced(CheckpointError):
    """The checkpoint being read was replaced or removed by a save (or a prune) meanwhile."""


# ------------------------------------------------------------------------- which checkpoint


def _sequence(path: Path) -> int:
    """The save's place in its folder's history (older checkpoints without one come first)."""
    try:
        meta = json.loads(read_manifest_bytes(path / MANIFEST))
    except FileNotFoundError:
        raise
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {error}") from None
    sequence = meta.get("sequence", -1) if isinstance(meta, dict) else None
    if not is_count(sequence, -1):
        raise CheckpointError(f"{path / MANIFEST}: 'sequence' must be an integer, got {sequence!r}")
    return sequence


def committed_steps(
    directory: Path, own_only: bool = False, readable_only: bool = False
) -> list[tuple[int, int, Path]]:
    """``(sequence, step, path)`` of the committed ``step-*`` checkpoints, oldest save first.

    A manifest that cannot be read raises (which one is newest is then unknown), or with
    ``readable_only`` is left out with a warning (a save or a prune goes on without it). One
    that disappears while the folder is listed was pruned by a save: it is left out."""
    found = []
    for path in directory.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (is_own_checkpoint(path) if own_only else (path / MANIFEST).is_file()):
            try:
                found.append((_sequence(path), int(match.group(1)), path))
            except FileNotFoundError:
                continue
            except CheckpointError as error:
                if not readable_only:
                    raise
                warnings.warn(f"{error}: left out of the save order and never pruned", stacklevel=2)
    return sorted(found)


def resolve(directory: str | os.PathLike) -> Path:
    """The committed checkpoint at ``directory``: itself, or its most recently saved ``step-*``."""
    if not os.fspath(directory):
        raise CheckpointError("no checkpoint at '': the path is empty")
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return directory
    if not directory.exists():
        replaced = replaced_path(directory)
        if (replaced / MANIFEST).is_file():
            raise CheckpointError(
                f"no checkpoint at {directory}: a save into it was interrupted between its two renames and left "
                f"the previous checkpoint complete at {replaced}; rename it to {directory.name} to use it"
            )
        raise CheckpointError(f"no checkpoint at {directory}")
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: it is not a folder")
    for _ in range(ATTEMPTS):  # a save committing and pruning meanwhile changes the listing: look again
        listed = sorted(p.name for p in directory.iterdir() if STEP_DIR.match(p.name))
        committed = committed_steps(directory)
        if committed:
            # A step folder linked out of the folder of saves is refused; a plain one lies within it (and
            # may be pruned meanwhile, which opening it finds and follows to the newer save).
            if committed[-1][2].is_symlink():
                confined(committed[-1][2], directory)
            return committed[-1][2]
        if sorted(p.name for p in directory.iterdir() if STEP_DIR.match(p.name)) == listed:
            break
    uncommitted = listed or [directory.name]
    raise CheckpointError(
        f"{directory} holds no committed shardavg checkpoint: {uncommitted} lack {MANIFEST}, "
        "so their save never completed"
    )


# ------------------------------------------------------------------------- one save, opened


class OpenCheckpoint:
    """The committed checkpoint at ``path``, opened once: its manifest (checked whole) and, as they
    are asked for, its shard files, all through one folder handle (see the module docstring).

    ``identity`` tells two opened saves apart (the manifest's checksum). Close it when done (or
    use ``with``); the files opened stay readable until then, whatever happens to the folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._shards: dict[int, SafetensorsFile] = {}
        try:
            self._dir: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CheckpointReplaced(f"{path} was removed while it was being opened") from None
        except OSError as error:
            raise CheckpointError(f"cannot open {path}: {error.strerror}") from None
        try:
            raw = self._read_manifest()
            self.description = parse_manifest(raw, str(path / MANIFEST))
            self.identity = self.description.checksum or "sha256:" + hashlib.sha256(raw).hexdigest()
        except BaseException:
            self.close()
            raise

    def _refuse_link(self, name: str) -> None:
        """Refuse ``name`` of the opened save where it is a link (see the module docstring), saying
        where it leads: out of the save (``confined``), or to a file within it."""
        try:
            linked = stat.S_ISLNK(os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_mode)
        except OSError:  # (missing: opening it says so)
            return
        if linked:
            real = confined(self.path / name, self.path)
            raise CheckpointError(
                f"{self.path / name} links to {real}: a save's files are its own, never links (shardavg writes none); "
                "copy the file in place of the link"
            )

    def _read_manifest(self) -> bytes:
        self._refuse_link(MANIFEST)
        try:
            return read_manifest_bytes(MANIFEST, self._dir, self.path / MANIFEST)
        except FileNotFoundError:
            raise self._missing(MANIFEST) from None

    def _missing(self, name: str) -> CheckpointError:
        """Why ``name`` is not in the opened folder: a newer save replaced it, or committed beside
        it and is pruning it (its files go one by one), or the checkpoint itself lacks the file."""
        try:
            here, opened = os.stat(self.path), os.fstat(self._dir)  # type: ignore[arg-type]
            replaced = (here.st_dev, here.st_ino) != (opened.st_dev, opened.st_ino)
        except FileNotFoundError:
            replaced = True
        if not replaced and STEP_DIR.match(self.path.name):
            try:
                replaced = resolve(self.path.parent) != self.path
            except CheckpointError:
                replaced = False
        if replaced:
            return CheckpointReplaced(f"{self.path} was replaced by a newer save (or pruned) while it was read")
        return CheckpointError(f"missing checkpoint file {self.path / name}")

    @property
    def version(self) -> int:
        return self.description.version

    def shard(self, index: int) -> SafetensorsFile:
        """The ``index``-th file of the manifest, opened (once) and checked to be this save's."""
        if index not in self._shards:
            name = self.description.files[index]
            self._refuse_link(name)
            try:
                file = SafetensorsFile.open(name, self._dir, self.path / name)
            except FileNotFoundError:
                raise self._missing(name) from None
            try:
                self._check_belongs(index, file)
            except BaseException:
                file.close()
                raise
            self._shards[index] = file
        return self._shards[index]

    def _check_belongs(self, index: int, file: SafetensorsFile) -> None:
        if self.version < 4:  # saved before files carried their save's id and size
            return
        expected = self.description.digests[index].bytes
        if file.size != expected:
            raise CheckpointError(
                f"{file.where} has {file.size} bytes, the manifest says {expected}: truncated, or not this save's file"
            )
        if file.metadata.get(SAVE_ID_KEY) != self.description.save_id:
            raise CheckpointError(
                f"{file.where} belongs to save {str(file.metadata.get(SAVE_ID_KEY))[:40]!r}, the manifest to "
                f"{self.description.save_id!r}: files of two saves are mixed in {self.path}"
            )

    def open_all(self) -> None:
        """Open every file now, so that nothing read later depends on the folder staying as it is."""
        reserve_descriptors(len(self.description.files))
        for index in range(len(self.description.files)):
            self.shard(index)

    def verify(self, indices: list[int] | None = None) -> int:
        """Hash the files (all, or ``indices``) and compare them with the manifest; returns the
        bytes checked. Refuses a checkpoint saved before hashes were recorded."""
        if self.version < 4:
            raise CheckpointError(
                f"{self.path} was saved by an older shardavg (format version {self.version}), which recorded no "
                "checksums: there is nothing to verify it against"
            )
        checked = 0
        for index in range(len(self.description.files)) if indices is None else indices:
            file = self.shard(index)
            if file.sha256() != self.description.digests[index].sha256:
                raise CheckpointError(
                    f"{file.where}: its content does not match the SHA-256 the manifest recorded when it was "
                    "written: the file was damaged or changed since"
                )
            checked += file.size
        return checked

    def close(self) -> None:
        for file in self._shards.values():
            file.close()
        self._shards.clear()
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_dir", None) is not None:
            self.close()


def open_checkpoint(directory: str | os.PathLike, every_file: bool = False) -> OpenCheckpoint:
    """The committed checkpoint at ``directory`` (see ``resolve``), opened; with ``every_file`` all
    its files opened at once. Follows newer saves that replace it meanwhile, up to ``ATTEMPTS`` times."""
    for _ in range(ATTEMPTS):
        opened = None
        try:
            opened = OpenCheckpoint(resolve(directory))
            if every_file:
                opened.open_all()
            return opened
        except CheckpointReplaced:
            if opened is not None:
                opened.close()
        except BaseException:
            if opened is not None:
                opened.close()
            raise
    raise busy_error(directory)


def busy_error(directory: str | os.PathLike) -> CheckpointError:
    return CheckpointError(
        f"{directory} was replaced by newer saves {ATTEMPTS} times while it was being read: read it when the "
        "job writing it pauses, or from a copy"
    )


def read_manifest(path: Path) -> Description:
    """The manifest of the checkpoint at ``path``, checked whole (description, checksum, chunk table)."""
    with OpenCheckpoint(path) as opened:
        return opened.description


def reserve_descriptors(count: int) -> None:
    """Raise this process's soft limit on open files, where it allows, to hold ``count`` more."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, limit), hard))
