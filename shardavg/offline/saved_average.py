"""Reading an averager checkpoint in one process, without a process group, tensor by tensor.

Two layouts are understood: ``avg.save``'s (a ``shardavg.json`` manifest and one safetensors
file per rank) and the entry an averager wrote into a ``torch.distributed.checkpoint``
folder. DCP stores its ``.metadata`` as a pickle; it is read with an unpickler that only
builds DCP's own metadata classes, and tensors with ``torch.load(weights_only=True)``, so a
checkpoint carrying a malicious pickle is refused before anything in it runs.
"""

from __future__ import annotations

import enum
import functools
import io
import json
import math
import os
import pickle
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from ..base.dtypes import dtype_name
from ..base.errors import CheckpointError
from ..base.links import own_file
from ..base.progress import Progress
from ..base.untrusted import check_pickle
from ..base.validate import is_count
from ..checkpoints.description import Description, TensorEntry, tensor_key
from ..checkpoints.format import DCP_METADATA, MANIFEST, MANIFEST_LIMIT, STEP_DIR, decode_description
from ..checkpoints.reading import open_checkpoint
from ..checkpoints.storage import read_bounded
from ..layouts.parts import Box, Part, tiles, within
from ..output.model_writer import write_model
from ..output.provenance import made_by, of_input, shown
from ..output.record import FolderRecord
from ..output.target import check_out
from ..output.write_options import DEFAULTS, WriteOptions

StoredChunk = tuple[list[Box], Callable[[torch.Tensor, int], None]]  # a chunk on disk: its boxes, fill(out, first row)
Rows = tuple[int, int] | None  # rows [start, stop) of a tensor; None: all of it
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file inside the checkpoint, never a path

_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core (since about 0.12) keeps its ranks' save plans in the metadata (``all_local_plans``):
    # torch's own data classes, built of the metadata classes above; nothing else of the planner's.
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes (and the save plans Megatron-Core stores with them), torch dtypes
    and sizes; refuses every other global.

    An enum's constructor hands back its existing member, the process's own, and a ``BUILD`` after
    it would set attributes on that member for every later user: each enum's members are noted as
    they were when the pickle first names the enum, and ``load`` puts back and refuses any change."""

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where
        self.members: dict[enum.Enum, dict[str, Any]] = {}  # each enum member named, as it was

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()):
            found = super().find_class(module, name)
            if isinstance(found, type) and issubclass(found, enum.Enum):
                for member in found:
                    self.members.setdefault(member, dict(vars(member)))
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} asks to load {module}.{name}, which a checkpoint has no business with: refused"
        )

    def load(self) -> Any:
        try:
            return super().load()
        finally:
            changed = [(member, was) for member, was in self.members.items() if vars(member) != was]
            for member, was in changed:  # (an enum hashes by its name: put back before it is hashed again)
                vars(member).clear()
                vars(member).update(was)
            if changed:  # (raised over whatever the load raised: this is what the file is)
                raise CheckpointError(
                    f"{self.where} sets attributes on torch's own {[str(m) for m, _ in changed]} (crafted): refused, "
                    "and the members put back as they were"
                )


class SavedAverage:
    """An averager's checkpoint opened for reading: ``description``, ``averages`` (their names,
    ``[None]`` for an averager with one rule) and ``read(name, average)``.

    A shardavg checkpoint is opened whole when this is built (``reading.open_checkpoint``): every
    file of one save, kept open until ``close()``, so a save into the same place meanwhile
    cannot mix into what is read."""

    def __init__(self, path: str | Path, key: str = "ema") -> None:
        if not os.fspath(path):
            raise CheckpointError("the checkpoint path is empty: name a checkpoint folder")
        path = Path(path)
        self._opened = None
        if os.path.lexists(path / DCP_METADATA):  # (a link too: ``read_dcp_metadata`` says where it may lead)
            self._open_dcp(path, key)
        elif not path.exists() or (path / MANIFEST).is_file() or any(STEP_DIR.match(p.name) for p in path.iterdir()):
            self._opened = open_checkpoint(path, every_file=True)  # one save, whatever is saved there meanwhile
            self.path, self.description, self.kind = self._opened.path, self._opened.description, "shardavg"
        else:
            raise CheckpointError(
                f"{path} is neither a shardavg checkpoint ({MANIFEST}) nor a DCP checkpoint (.metadata)"
            )
        self.tensors = {entry.name: entry for entry in self.description.tensors}
        self.canonical = {alias: entry.name for alias, entry in self.description.by_name().items()}
        self.averages: list[str | None] = self.description.average_names

    def average(self, name: str | None) -> str | None:
        """The average called ``name``; ``None`` picks the only one, when there is one."""
        if name is None and len(self.averages) == 1:
            return self.averages[0]
        if name not in self.averages:
            named = [n for n in self.averages if n is not None]
            raise CheckpointError(
                f"{self.path} holds averages {named}: name one (--average)"
                if name is None
                else f"{self.path} has no average {name!r}; it holds "
                + (f"{named}" if named else "one, unnamed: leave --average out")
            )
        return name

    def key(self, name: str, average: str | None) -> str:
        """The key tensor ``name`` of ``average`` is stored under."""
        return tensor_key(average, name) if self.tensors[name].role == "average" else name

    # --------------------------------------------------------------- export

    def export(
        self,
        out: str | os.PathLike,
        *,
        average: str | None = None,
        dtype: torch.dtype | None = DEFAULTS.dtype,
        max_shard_size: int | str = DEFAULTS.max_shard_size,
        verify: bool = False,
        progress: Progress | None = None,
    ) -> Path:
        """Write ``average`` as a model folder into ``out`` (``shardavg export``), one tensor at a time.

        OUT and every chunk table are checked before anything is written (and with ``verify``,
        every file against its recorded SHA-256); the folder records the export and this
        checkpoint as its input (``provenance.json``).

        Args:
            out: the model folder to write (beside the checkpoint is fine, inside it is not).
            average: which average, when the averager kept several.
            dtype: the floating tensors' dtype (``WriteOptions.dtype``; default: as saved).
            max_shard_size: the largest file before the model is split (``WriteOptions.max_shard_size``).
            verify: first hash every file against the SHA-256 recorded when it was written.
            progress: shows the bytes read as they are written (default: nothing shown).

        Returns:
            The folder written.

        Raises:
            CheckpointError: an OUT that cannot take the export, a checkpoint saved before any
                update, or a damaged checkpoint; nothing is written then.
        """
        options = WriteOptions(max_shard_size=max_shard_size, dtype=dtype)
        check_out(out, "export", [self.path], beside=True)
        average = self.average(average)
        description = self.description
        if description.num_updates == 0:
            raise CheckpointError(f"{self.path} was saved before any update was applied: it holds no average to export")
        self.verify()  # a damaged chunk table is refused before anything is written
        if verify:
            self.verify_contents()
        progress = Progress("export", quiet=True) if progress is None else progress
        total = sum(entry.nbytes for entry in description.tensors)
        values = progress.counted((self.read(entry.name, average) for entry in description.tensors), total)
        made = made_by(
            "export", 1, average=average, step=description.step, dtype=None if dtype is None else dtype_name(dtype),
            inputs=[of_input(self.path, description.step, 1.0, description.run)],
        )  # fmt: skip
        record = FolderRecord.of_average(description, average, False, made)
        with progress:
            return write_model(out, description.tensors, values, record, options.max_bytes, options.dtype)

    # --------------------------------------------------------------- DCP

    def _open_dcp(self, path: Path, key: str) -> None:
        self._dcp = DcpFolder(path)
        self.path, self.kind, self._prefix = path, "dcp", f"{key}."
        entries = self._dcp.metadata.state_dict_metadata
        if f"{key}.meta" not in entries:
            found = sorted({str(name).split(".")[0] for name in entries})
            raise CheckpointError(f"{path} has no averager under key {key!r} (top-level keys: {found})")
        meta = self._dcp.item(f"{key}.meta", None, limit=64 * 2**20)
        self.description = decode_description(meta, f"{path} [{key}]")

    # --------------------------------------------------------------- reading

    def verify(self) -> None:
        """Check every tensor's chunk table against the files it names, reading no tensor data."""
        for name in self.tensors:
            for average in self.averages:
                self._chunks(name, self.key(name, average))

    def summary(self, verify: bool = False) -> list[tuple[str, Any]]:
        """What ``shardavg inspect`` shows of it, as ``(label, value)`` rows: step, updates, rules,
        strategy, tensors by role, bytes, the saving ranks' layouts and the provenance.

        Args:
            verify: Also read every file and check its SHA-256 against the manifest.

        Returns:
            The rows, in order.
        """
        description = self.description
        tensors = description.tensors
        size = sum(t.nbytes for t in tensors)
        roles = Counter(t.role for t in tensors)
        where = f"{self.path}" + (" (torch.distributed.checkpoint)" if self.kind == "dcp" else "")
        rows: list[tuple[str, Any]] = [
            ("checkpoint", where),
            ("step", description.step),
            ("num_updates", _updates(description)),
            *(
                ("rule" if average.name is None else f"average {average.name}", json.dumps(average.rule))
                for average in description.averages
            ),
            ("strategy", f"{description.strategy} on {description.world_size} rank(s)"),
            ("tensors", f"{len(tensors)}: " + ", ".join(f"{n} {role}" for role, n in sorted(roles.items()))),
            ("bytes", f"{size} ({size / 2**20:.1f} MiB)"),
            *(("layout", line) for line in _layouts(tensors)),
        ]
        if verify:
            files, checked = self.verify_contents()
            rows.append(("verified", f"{files} file(s), {checked} bytes: every SHA-256 matches the manifest"))
        if description.provenance is not None:
            rows += [("provenance", line) for line in shown(description.provenance)]
        return rows

    def verify_contents(self) -> tuple[int, int]:
        """Hash every file and compare it with the SHA-256 recorded when it was written; returns
        (files, bytes) checked. A DCP checkpoint records none: refused."""
        if self._opened is None:
            raise CheckpointError(f"{self.path} is a DCP checkpoint, which records no checksums: nothing to verify")
        return len(self.description.files), self._opened.verify()

    def close(self) -> None:
        """Let go of the open files (they are closed when this object is collected, too)."""
        if self._opened is not None:
            self._opened.close()

    def read(self, name: str, average: str | None = None, rows: Rows = None) -> torch.Tensor:
        """The full tensor ``name`` (any of a tied tensor's names) of ``average`` in its original shape,
        or only its ``rows`` (one tensor in memory at a time; only the chunks across those rows read).

        Every stored chunk is checked (where it lies, that the chunks tile the tensor, dtype and
        size) before the tensor is allocated, so a damaged table never yields unwritten memory.
        """
        name = self.canonical.get(name, name)  # a tied tensor is stored under its first name
        key = self.key(name, self.average(average))
        dtype, shape = self.tensors[name].torch_dtype, self.tensors[name].shape
        chunks = self._chunks(name, key)
        out = torch.empty(rows_shape(shape, rows), dtype=dtype)
        for _, fill in chunks:
            fill(out, rows[0] if rows else 0)
        return out

    def _chunks(self, name: str, key: str) -> list[StoredChunk]:
        """``(boxes, fill)`` for each chunk stored under ``key`` of tensor ``name``, the boxes checked
        to tile it; ``fill(full)`` reads the chunk into its place in the full tensor ``full``."""
        entry = self.tensors[name]
        chunks = self._dcp_chunks(key, entry) if self.kind == "dcp" else self._shard_chunks(name, key)
        boxes = [box for held, _ in chunks for box in held]
        if not tiles(entry.shape, boxes):
            raise CheckpointError(
                f"{self.path}: the chunks of {key!r} {boxes[:8]} do not tile its shape {list(entry.shape)}"
            )
        return chunks

    def _shard_chunks(self, name: str, key: str) -> list[StoredChunk]:
        entry, chunks = self.tensors[name], []
        for owner, part in entry.layout.owned:  # type: ignore[union-attr]
            file = self._opened.shard(owner)  # type: ignore[union-attr]
            file.checked(key, entry.dtype, part.numel)
            for block in part.packed().blocks:

                def fill(
                    piece: torch.Tensor, start: int, file=file, at=block.at, box=(block.offsets, block.sizes)
                ) -> None:
                    met = meet(box, piece, start)
                    if met is not None:
                        file.read_box(piece[met[0]], key, at, box[1], met[1])

                chunks.append(([(block.offsets, block.sizes)], fill))
        return chunks

    def _dcp_chunks(self, key: str, entry: TensorEntry) -> list[StoredChunk]:
        """Each chunk DCP stored: since format version 5 DCP holds every tensor in its own shape (a
        0-d one as one element), each chunk a box; before, flattened, each chunk a range."""
        shape, dtype = entry.shape, entry.torch_dtype
        flattened = self.description.version < 5 or not shape
        stored_shape = (math.prod(shape),) if flattened else shape
        found = []
        for offsets, sizes, load in self._dcp.boxes(f"{self._prefix}tensors.{key}", stored_shape, dtype):
            if flattened:  # a range of the flattened tensor: its boxes, for the tiling check
                start, end = offsets[0], offsets[0] + sizes[0]
                found.append((Part.flat(shape, start, end).boxes, functools.partial(_fill_range, load, start, end)))
            else:
                found.append(([(offsets, sizes)], functools.partial(_fill_box, load, (offsets, sizes))))
        return found


def _layouts(tensors: Sequence[TensorEntry]) -> list[str]:
    """How the saving ranks held the tensors, in words, the commonest first (a checkpoint of
    ``avg.save``; DCP's chunks are its own)."""
    shown = Counter(entry.layout.shown() for entry in tensors if entry.layout is not None)
    return [f"{count} tensor{'s' if count > 1 else ''}: {words}" for words, count in shown.most_common()]


def _updates(description: Description) -> str:
    if description.num_updates == 0:
        return "0 (saved before the first update: no average yet, nothing to export)"
    return f"{description.num_updates} ({description.num_skipped} skipped for non-finite weights)"


class DcpFolder:
    """A ``torch.distributed.checkpoint`` folder opened for reading in one process: its metadata
    (read with the restricted unpickler) and its items, each checked to lie in a regular file of
    the folder and loaded with ``torch.load(weights_only=True)``, one at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata = read_dcp_metadata(path)
        self._files: dict[str, tuple[Path, int]] = {}  # its files found so far (see ``_dcp_item_location``)

    def tensors(self, prefix: str) -> dict[str, Any]:
        """The tensor entries whose key starts with ``prefix``: ``{key: TensorStorageMetadata}``."""
        return {
            str(key): stored
            for key, stored in self.metadata.state_dict_metadata.items()
            if str(key).startswith(prefix) and isinstance(getattr(stored, "chunks", None), list)
        }

    def location(self, fqn: str, offset: Any, limit: int) -> tuple[Path, int, int]:
        """Where DCP stored an item: a regular file inside the checkpoint, at most ``limit`` bytes,
        within the file. Checked before anything is read."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data.get(MetadataIndex(fqn, offset))
        if info is None:
            raise CheckpointError(f"{self.path}: no stored data for {fqn} at {offset}")
        file, start, length = _dcp_item_location(self.path, fqn, info, self._files)
        if length > limit:
            raise CheckpointError(f"{file}: {fqn} claims {length} bytes (at most {limit} expected)")
        return file, start, length

    def item(self, fqn: str, offset: Any, limit: int) -> Any:
        """One item DCP stored, loaded with ``torch.load(weights_only=True)``: no Python objects."""
        file, start, length = self.location(fqn, offset, limit)
        try:
            with open(file, "rb") as handle:
                handle.seek(start)
                data = handle.read(length)
            with warnings.catch_warnings():  # (torch warns of a pickle protocol above 2, then refuses the pickle)
                warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:  # torch.load refuses anything but tensors and plain containers
            raise CheckpointError(f"cannot read {fqn} from {file}: {_load_failure(error)}") from error

    def boxes(
        self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[tuple[tuple[int, ...], tuple[int, ...], Callable[[], torch.Tensor]]]:
        """``(offsets, sizes, load)`` of each non-empty chunk of the tensor ``fqn``, stored in ``shape``:
        the chunk table checked whole first (``_table``), then each chunk's data found in the folder;
        ``load()`` reads it."""
        stored = self.metadata.state_dict_metadata.get(fqn)
        chunks = getattr(stored, "chunks", None)
        if not isinstance(chunks, list):
            raise CheckpointError(f"{self.path} lacks {fqn}")
        found = []
        for offsets, sizes in self._table(fqn, chunks, shape):
            limit = math.prod(sizes) * dtype.itemsize + 2**16  # the tensor's bytes and torch.save's framing
            self.location(fqn, offsets, limit)
            found.append((offsets, sizes, functools.partial(self._chunk, fqn, offsets, sizes, dtype, limit)))
        return found

    def _table(self, fqn: str, chunks: list[Any], shape: tuple[int, ...]) -> list[Box]:
        """The non-empty boxes of the chunk table ``chunks`` of the tensor ``fqn``, stored in ``shape``,
        checked before any chunk is looked for: each chunk a box of the tensor at offsets of its own
        (DCP stores a chunk under its tensor and offsets, so two at the same offsets cannot both be
        stored), the non-empty ones tiling it. Their number is bounded first, in O(1), by the places a
        box can start in ``shape`` and by the items the checkpoint stores (one per chunk): a table
        listing one box millions of times is refused at once, before any loop over it."""
        where = self.path / DCP_METADATA
        places, items = math.prod(size + 1 for size in shape), len(self.metadata.storage_data)
        if len(chunks) > min(places, items):
            held = (
                f"its shape {list(shape)} has only {places} offsets to start one at"
                if places <= items
                else f"the checkpoint stores only {items} items, one per chunk"
            )
            raise CheckpointError(
                f"{where}: {fqn!r} lists {len(chunks)} chunks, but {held}: a chunk table that repeats a box cannot "
                "tile its tensor (damaged or crafted); refused, nothing read"
            )
        boxes, seen = [], set()
        for chunk in chunks:
            offsets, sizes = _box(getattr(chunk, "offsets", None), getattr(chunk, "sizes", None), shape)
            if offsets is None:
                raise CheckpointError(f"{where}: {fqn} has a chunk {chunk!r}, not a box of {list(shape)}")
            if offsets in seen:
                raise CheckpointError(
                    f"{where}: {fqn!r} lists two chunks at offsets {list(offsets)}: a chunk table that repeats a box "
                    "cannot tile its tensor (damaged or crafted); refused, nothing read"
                )
            seen.add(offsets)
            if math.prod(sizes):
                boxes.append((offsets, sizes))
        if not tiles(shape, boxes):
            raise CheckpointError(f"{where}: the chunks of {fqn!r} {boxes[:8]} do not tile its shape {list(shape)}")
        return boxes

    def read(self, fqn: str, rows: Rows = None) -> torch.Tensor:
        """The whole tensor ``fqn`` in its stored shape and dtype, or only its ``rows`` (only the
        chunks across them loaded), its chunks checked to tile it first."""
        stored = self.metadata.state_dict_metadata[fqn]
        shape, dtype = tuple(stored.size), stored.properties.dtype
        chunks = self.boxes(fqn, shape, dtype)
        out = torch.empty(rows_shape(shape, rows), dtype=dtype)
        for offsets, sizes, load in chunks:
            _fill_box(load, (offsets, sizes), out, rows[0] if rows else 0)
        return out

    def _chunk(self, fqn: str, offsets: tuple, sizes: tuple, dtype: torch.dtype, limit: int) -> torch.Tensor:
        """One chunk DCP stored, checked to be the tensor its metadata says."""
        loaded = self.item(fqn, offsets, limit)
        if not isinstance(loaded, torch.Tensor) or loaded.dtype != dtype or tuple(loaded.shape) != sizes:
            got = f"{loaded.dtype} {tuple(loaded.shape)}" if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise CheckpointError(f"{self.path}: a chunk of {fqn!r} is {got}, expected {dtype} {list(sizes)}")
        return loaded


def _load_failure(error: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one line. Its refusal of a pickled Python
    object runs to several lines that advise loading it again with ``weights_only=False``, which
    would run whatever the file holds: never the advice here. Any other failure: its first line."""
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) or "Weights only load failed" in text:
        return "it holds pickled Python objects, not tensor data; shardavg never unpickles Python objects"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def rows_shape(shape: tuple[int, ...], rows: Rows) -> tuple[int, ...]:
    """The shape of rows ``[start, stop)`` of a tensor of ``shape`` (all of it without ``rows``)."""
    return shape if rows is None else (rows[1] - rows[0], *shape[1:])


def meet(box: Box, piece: torch.Tensor, start: int) -> tuple[tuple[slice, ...], tuple[int, ...]] | None:
    """Where ``box`` of a tensor meets ``piece``, its rows from ``start`` on: the piece's slices that
    take it, and where they begin within the box; None where they do not meet."""
    offsets, sizes = box
    if not offsets:  # a 0-d tensor: one element, all of it
        return (), ()
    low, high = max(start, offsets[0]), min(start + piece.shape[0], offsets[0] + sizes[0])
    if high <= low:
        return None
    slices = (slice(low - start, high - start), *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:])))
    return slices, (low - offsets[0], *(0,) * (len(offsets) - 1))


def _fill_range(load: Callable[[], torch.Tensor], first: int, end: int, piece: torch.Tensor, start: int) -> None:
    """Elements ``[first, end)`` of the flattened tensor (``load()``), where they meet ``piece``."""
    base = start * math.prod(piece.shape[1:])
    low, high = max(first, base), min(end, base + piece.numel())
    if high > low:
        piece.view(-1)[low - base : high - base].copy_(load()[low - first : high - first])


def _fill_box(load: Callable[[], torch.Tensor], box: Box, piece: torch.Tensor, start: int) -> None:
    """The chunk ``box`` of the tensor (``load()``), where it meets ``piece``."""
    met = meet(box, piece, start)
    if met is not None:
        piece[met[0]].copy_(load()[tuple(slice(o, o + n.stop - n.start) for o, n in zip(met[1], met[0]))])


def _box(offsets: Any, sizes: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """``(offsets, sizes)`` as tuples when they are a box within ``shape``, else ``(None, None)``."""
    if not (isinstance(offsets, (tuple, list, torch.Size)) and isinstance(sizes, (tuple, list, torch.Size))):
        return None, None
    if not all(map(is_count, [*offsets, *sizes])) or not within(shape, (tuple(offsets), tuple(sizes))):
        return None, None
    return tuple(offsets), tuple(sizes)


def read_dcp_metadata(path: str | os.PathLike) -> Any:
    """The ``.metadata`` of the DCP checkpoint at ``path``, unpickled with an unpickler that builds
    nothing but DCP's metadata classes and torch's save plans, which Megatron-Core stores there
    (``dcp.load`` would unpickle anything in it), after its size, nesting and the objects it would
    build are bounded (``check_pickle``: a key nested 200,000 tuples deep kills the unpickler)."""
    where = Path(path) / DCP_METADATA
    real = own_file(where, Path(path), "not a DCP checkpoint")

    def too_large(size: int) -> CheckpointError:  # (a crafted one is refused before it is read)
        return CheckpointError(
            f"{where} is {size} bytes, more than DCP metadata may hold here ({MANIFEST_LIMIT} bytes)"
        )

    raw = read_bounded(real, MANIFEST_LIMIT, too_large, where=where)
    try:
        check_pickle(raw, where)  # (its nesting and objects counted first: a tuple 200,000 deep kills unpickling)
        metadata = _MetadataUnpickler(io.BytesIO(raw), str(where)).load()
    except CheckpointError:
        raise
    except Exception as error:  # a truncated or garbage pickle fails in many ways
        raise CheckpointError(f"cannot read {where}: {type(error).__name__}: {error}") from error
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict) or not isinstance(
        getattr(metadata, "storage_data", None), dict
    ):
        raise CheckpointError(f"{where} is not DCP metadata")
    return metadata


def check_dcp(path: str | os.PathLike) -> Any:
    """Check a ``torch.distributed.checkpoint`` folder before ``dcp.load`` trusts it; returns its metadata.

    ``.metadata`` is read with the restricted unpickler, and every item it lists must lie in a
    regular file of the folder (a plain name, never a path), within that file's size: a missing
    or truncated ``.distcp`` file, or garbage metadata, is refused with one message naming it.
    The items' bytes are not read (DCP records no checksum of them).

    Args:
        path: the DCP checkpoint folder.

    Returns:
        Its metadata (``torch.distributed.checkpoint.metadata.Metadata``).

    Raises:
        CheckpointError: naming the file or item at fault.
    """
    path = Path(path)
    metadata = read_dcp_metadata(path)
    check_dcp_items(path, metadata)
    return metadata


def check_dcp_items(path: Path, metadata: Any) -> None:
    """Every item the DCP ``metadata`` of ``path`` lists in place (see ``check_dcp``)."""
    files: dict[str, tuple[Path, int]] = {}
    for index, info in metadata.storage_data.items():
        _dcp_item_location(path, getattr(index, "fqn", index), info, files)


def _dcp_item_location(path: Path, fqn: Any, info: Any, files: dict[str, tuple[Path, int]]) -> tuple[Path, int, int]:
    """``(file, offset, length)`` of an item DCP stored, checked to lie in a regular file of ``path``
    (``own_file``: a link out of it refused), ``file`` its real path. ``files``: ``{name: (real path,
    size)}`` of the files found so far, each checked once (a checkpoint of 20,000 items in a few files
    would otherwise follow every link 20,000 times)."""
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{path}: {fqn} is stored with transforms {info.transform_descriptors}, unsupported")
    name, start, length = (getattr(info, key, None) for key in ("relative_path", "offset", "length"))
    if not (isinstance(name, str) and PLAIN_NAME.match(name) and is_count(start) and is_count(length)):
        raise CheckpointError(f"{path}: {fqn} is stored at {name!r} [{start!r}, +{length!r}), refused")
    file = path / name
    if name not in files:
        real = own_file(file, path, "refused")
        files[name] = real, real.stat().st_size
    real, size = files[name]
    if start + length > size:
        raise CheckpointError(
            f"{file}: {fqn} claims bytes {start}..{start + length} of a {size}-byte file (truncated?)"
        )
    return real, start, length
