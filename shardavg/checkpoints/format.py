"""Everything shardavg writes, as it lies on disk: names, the description, the manifest, the chunk table.

One averager's saved state is a *description* (counters, averages and their rules, options, and
every tensor's name, aliases, kind, role, shape and dtype), JSON with a checksum of its own
content, and the tensors' values. ``avg.save`` writes the description as the manifest
``shardavg.json`` with the files' sizes, hashes and save id and each tensor's chunk table, next
to one safetensors file per rank; DCP holds it as a JSON string beside the tensors; an export
carries the rule and counters in its safetensors metadata. Every reader passes what it read
through ``check_description`` (and ``parse_manifest`` for a manifest): a damaged or crafted
description is refused whole, with one message naming where it came from and the field at
fault, before anything changes.

Since format version 6 a manifest says where each tensor lies by its *layout*
(``tensor_layout.py``): the rule the saving ranks' parts followed ("dim 0 split in 4,096 as
torch.chunk does over grid 0", "elements [o, o + n) of a flat buffer split in ranges of c"),
with the grids of ranks listed once, so its size grows with the tensors, not tensors x ranks;
file ``r`` holds what rank ``r`` owned, its boxes back to back. A tensor whose layout could not
be derived (and every tensor before version 6) has a chunk table instead: each chunk a box of
the tensor (offsets and sizes in the tensor itself) that a file's entry holds from its element
``at``, row-major, the file's boxes back to back. Before version 5 a chunk was a range of the
flattened tensor: such tables are read as the boxes of their ranges. Either way a reader gets
one ``TensorLayout`` per tensor (``entry["layout"]``), checked to tile it exactly.

A manifest comes from a file anyone could have written, so every count in it is checked against
what it must match before anything is allocated or looped over: its size against
``MANIFEST_LIMIT``, the number of files against the digests, a grid's ranks against the files, a
tensor's bytes against the files' bytes, a split factor against the dim it splits, and the boxes a
layout cuts a tensor into against ``LAYOUT_BOXES``. A provenance record (``check_provenance``) is
bounded and typed the same way, in a manifest or in a model folder's ``provenance.json``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from ..base.dtypes import DTYPES
from ..base.errors import CheckpointError, LayoutError, ProvenanceError
from ..base.validate import AVERAGE_NAME, RUN_ID, is_count, nesting
from ..layouts.parts import Block, Part, contiguous_strides, tiles
from ..layouts.tensor_info import TensorKind
from ..layouts.tensor_layout import (
    LAYOUT_BOXES,
    Grid,
    ListedLayout,
    MeshLayout,
    Owned,
    TensorLayout,
    grid_from_json,
    layout_from_json,
    most_boxes,
)
from ..rules import Rule
from ..strategies import SAVED_STRATEGIES
from ..update.options import Options, Role
from .description import (
    CHECKSUM,
    FORMAT,
    VERSION,
    DescribedAverage,
    Description,
    FileDigest,
    TensorEntry,
    checksum,
    with_checksum,
)
from .storage import read_bounded

MANIFEST = "shardavg.json"  # a checkpoint's description, chunk tables and files; written last
CHECKPOINT_FILE = re.compile(r"^(shardavg\.json|rank-\d{5}-of-\d{5}\.safetensors)$")
STEP_DIR = re.compile(r"^step-(\d+)$")  # a keep_last folder's checkpoints
SNAPSHOT_DIR = re.compile(r"^snapshot-(\d+)$")  # a PostHocEMA's snapshots, by update count
STEP_NAME = re.compile(r"^(?:step-|checkpoint-|global_step)(\d+)$")  # a checkpoint of shardavg, HF Trainer, DeepSpeed
DCP_METADATA = ".metadata"  # a torch.distributed.checkpoint folder's index
WEIGHTS_FILE = "model.safetensors"  # a model folder's weights in one file (Hugging Face's name)
WEIGHTS_INDEX = "model.safetensors.index.json"  # or its index, over model-ID-0000k-of-0000N.safetensors
SAVE_ID_KEY = "shardavg_save"  # in each shard's safetensors metadata: the save it belongs to
SAVE_ID = RUN_ID
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MANIFEST_LIMIT = 2**28  # bytes a manifest may hold: a million tensors' entries of 256 bytes (DCP's item: 64 MiB)
TENSOR_DIMS = 64  # dims a described tensor may have
GRID_DIMS = 16  # dims a grid of ranks may have (a device mesh has a handful)
PROVENANCE_LIMIT = 2**24  # bytes a provenance.json may hold
PROVENANCE_DEPTH = 100  # arrays and objects nested in a provenance record: 32 merges of merges, 3 levels each


def shard_file(rank: int, world: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint written by ``world`` ranks."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def step_folder(step: int) -> str:
    """The name of a ``keep_last`` checkpoint of step ``step`` (nine digits: a billion steps sort)."""
    return f"step-{step:09d}"


def snapshot_folder(updates: int) -> str:
    """The name of a ``PostHocEMA`` snapshot taken after ``updates`` updates."""
    return f"snapshot-{updates:09d}"


# ------------------------------------------------------------------------- the description, typed

KINDS, ROLES = get_args(TensorKind), get_args(Role)
REQUIRED = ("step", "num_updates", "num_skipped", "averages", "strategy", "world_size", "options", "tensors")
REQUIRED_V2 = tuple("rule" if key == "averages" else key for key in REQUIRED)
REQUIRED_V1 = ("step", "num_updates", "rule", "tensors")


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor (``offsets`` and ``sizes`` in the tensor) that file ``file`` holds from its
    element ``at``, row-major: one row of a manifest's chunk table."""

    file: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offsets": list(self.offsets), "sizes": list(self.sizes), "at": self.at}


def check_description(meta: Any, where: str) -> Description:
    """Refuse anything that is not a complete, well-typed description written by a shardavg
    (``where`` names its origin in the message); older versions' one ``"rule"`` becomes one
    unnamed average."""
    try:
        return _typed(_checked_description(meta, where))
    except RecursionError:  # (a value nested ~1,000 deep: its checksum, or its message, recurses)
        raise invalid(where, "a value is nested too deeply to be a description shardavg wrote") from None


def invalid(where: str, what: str) -> CheckpointError:
    """The error for a description that ``where`` holds and that is wrong in ``what``."""
    return CheckpointError(f"{where}: {what}")


def _check_averages(averages: Any, where: str) -> None:
    """A non-empty list of ``{"name", "rule"}``: plain, distinct names, or one unnamed average."""
    if not isinstance(averages, list) or not averages:
        raise invalid(where, f"'averages' must be a non-empty list, got {str(averages)[:200]}")
    for entry in averages:
        if not isinstance(entry, dict) or set(entry) != {"name", "rule"}:
            raise invalid(where, f"an 'averages' entry must hold 'name' and 'rule', got {str(entry)[:200]}")
        Rule.from_json(entry["rule"], where)
    names = [entry["name"] for entry in averages]
    unnamed = names == [None]
    if not unnamed and not all(isinstance(n, str) and AVERAGE_NAME.match(n) for n in names):
        raise invalid(where, f"average names {names} must be plain names, or one average with name null")
    if len(set(names)) != len(names):
        raise invalid(where, f"average names {names} repeat")


def _check_tensor(entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise invalid(where, f"a tensor entry is {type(entry).__name__}, not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(where, f"a tensor entry has no name: {str(entry)[:200]}")
    aliases = entry.get("aliases")
    problems = []
    if not isinstance(aliases, list) or not all(isinstance(alias, str) and alias for alias in aliases):
        problems.append(f"aliases {aliases!r} are not a list of names")
    if entry.get("kind") not in KINDS:
        problems.append(f"kind {entry.get('kind')!r} is not one of {KINDS}")
    if entry.get("role") not in ROLES:
        problems.append(f"role {entry.get('role')!r} is not one of {ROLES}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > TENSOR_DIMS or not all(is_count(dim) for dim in shape):
        problems.append(f"shape {str(shape)[:200]} is not a list of at most {TENSOR_DIMS} sizes")
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
        problems.append(f"dtype {entry.get('dtype')!r} is not one of {sorted(DTYPES)}")
    if problems:
        raise invalid(where, f"tensor {name!r}: " + "; ".join(problems))


def _checked_description(meta: Any, where: str) -> dict[str, Any]:
    """The raw JSON of a description, checked whole; older versions' one ``"rule"`` given as
    ``"averages"``, as version 3 writes."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a shardavg checkpoint description")
    version = meta.get("version")
    if not is_count(version, 1) or version > VERSION:
        raise CheckpointError(f"{where} has format version {version!r}; this shardavg reads up to {VERSION}")
    if CHECKSUM in meta or version >= 2:
        if meta.get(CHECKSUM) != checksum(meta):
            raise invalid(where, "the checksum does not match the content: the file was edited or damaged")
    required = REQUIRED_V1 if version == 1 else REQUIRED_V2 if version == 2 else REQUIRED
    missing = [key for key in required if key not in meta]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    for key, minimum in (("step", 0), ("num_updates", 0), ("num_skipped", 0), ("world_size", 1)):
        if key in meta and not is_count(meta[key], minimum):
            raise invalid(where, f"{key!r} must be an integer >= {minimum}, got {meta[key]!r}")
    if version < 3:  # one unnamed average, described by "rule"
        rule = meta["rule"]
        meta = {key: value for key, value in meta.items() if key != "rule"} | {
            "averages": [{"name": None, "rule": rule}]
        }
    _check_averages(meta["averages"], where)
    if "strategy" in meta and not (isinstance(meta["strategy"], str) and meta["strategy"] in SAVED_STRATEGIES):
        raise invalid(where, f"'strategy' must be one of {sorted(SAVED_STRATEGIES)}, got {meta['strategy']!r}")
    if "options" in meta:  # (typed here: a manifest's other checks follow, on the same dict)
        meta = meta | {"options": Options.from_json(meta["options"], where)}
    if "run" in meta and not (isinstance(meta["run"], str) and RUN_ID.match(meta["run"])):
        raise invalid(where, f"'run' must be 32 hex digits, got {str(meta['run'])[:80]!r}")
    if "sequence" in meta and not is_count(meta["sequence"]):
        raise invalid(where, f"'sequence' must be an integer >= 0, got {str(meta['sequence'])[:80]}")
    if meta.get("provenance") is not None:
        check_provenance(meta["provenance"], f"{where}: 'provenance'")
    if not isinstance(meta["tensors"], list):
        raise invalid(where, "'tensors' must be a list")
    names: set[str] = set()
    for entry in meta["tensors"]:
        _check_tensor(entry, where)
        for name in (entry["name"], *entry["aliases"]):
            if name in names:
                raise invalid(where, f"the name {name!r} appears twice")
            names.add(name)
    return meta


def _typed(meta: dict[str, Any], layouts: Sequence[TensorLayout | None] = (), **manifest: Any) -> Description:
    """A checked description's JSON as typed values, each entry with its layout from ``layouts``
    and the ``manifest``'s fields (a manifest's, parsed by ``parse_manifest``)."""
    layouts = layouts or [None] * len(meta["tensors"])
    return Description(
        step=meta["step"],
        num_updates=meta["num_updates"],
        num_skipped=meta.get("num_skipped", 0),
        averages=tuple(DescribedAverage(a["name"], a["rule"]) for a in meta["averages"]),
        tensors=tuple(
            TensorEntry(t["name"], tuple(t["aliases"]), t["kind"], t["role"], tuple(t["shape"]), t["dtype"], layout)
            for t, layout in zip(meta["tensors"], layouts)
        ),
        strategy=meta.get("strategy"),
        world_size=meta.get("world_size"),
        options=meta.get("options"),
        run=meta.get("run"),
        provenance=meta.get("provenance"),
        version=meta["version"],
        checksum=meta.get(CHECKSUM),
        **manifest,
    )


def encode_description(description: Description) -> str:
    """The description as a JSON string, as DCP stores it: a plain ``str`` through ``torch.save``,
    which the offline reader loads back with ``weights_only=True`` (no Python objects)."""
    return json.dumps(description.to_json())


def decode_description(value: Any, where: str) -> Description:
    """A description DCP stored (``encode_description``), checked whole."""
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: 'meta' is {type(value).__name__}, not a shardavg description")
    try:
        meta = json.loads(value)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{where}: 'meta' is not valid JSON: {error}") from None
    return check_description(meta, where)


# ------------------------------------------------------------------------- the manifest and chunk tables


def manifest_json(
    description: Description, layouts: Sequence[TensorLayout], digests: Sequence[FileDigest], sequence: int,
    save_id: str,
) -> dict[str, Any]:  # fmt: skip
    """The manifest of a save: the description, each tensor's layout (its grid of ranks listed once)
    or, where it was gathered, its chunk table, every file's size and hash, and the save's sequence
    number and id. File ``r`` (``shard_file(r, len(digests))``) holds what rank ``r`` owns."""
    grids = {layout.grid.digest: layout.grid for layout in layouts if not isinstance(layout, ListedLayout)}
    index = {digest: position for position, digest in enumerate(grids)}
    manifest = description.to_json() | {
        "files": len(digests),
        "digests": [[d.bytes, d.sha256] for d in digests],
        "save_id": save_id,
        "sequence": sequence,
        "grids": [grid.to_json() for grid in grids.values()],
    }
    manifest["tensors"] = [
        entry.to_json()
        | (
            {"chunks": [chunk.to_json() for chunk in chunk_table(layout.owned)]}
            if isinstance(layout, ListedLayout)
            else {"layout": layout.to_json(index)}
        )
        for entry, layout in zip(description.tensors, layouts)
    ]
    return with_checksum(manifest)


def chunk_table(owned: Sequence[Owned]) -> list[Chunk]:
    """A tensor's owned parts as a chunk table records them: each owner's boxes, back to back in its file."""
    return [
        Chunk(owner, block.offsets, block.sizes, block.at) for owner, part in owned for block in part.packed().blocks
    ]


def saved_length(layout: TensorLayout, file: int) -> int:
    """Elements file ``file`` holds of a tensor: the part its rank owned, its boxes back to back."""
    return layout.part(file).numel


def parse_manifest(raw: bytes, where: str) -> Description:
    """A manifest's bytes, checked whole: the description, then the files (shardavg's own names,
    with their sizes, hashes and save id since version 4), and each tensor's layout (or chunk
    table) tiling it exactly, every count bounded first (see the module docstring)."""
    if len(raw) > MANIFEST_LIMIT:
        raise manifest_too_large(where, len(raw))
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"cannot read {where}: {error}") from None
    try:
        return _parsed_manifest(meta, where)
    except RecursionError:  # (a value nested ~1,000 deep: its checksum, or its message, recurses)
        raise invalid(where, "a value is nested too deeply to be a manifest shardavg wrote") from None


def manifest_too_large(where: str, size: int) -> CheckpointError:
    """The error for a manifest of ``size`` bytes, over ``MANIFEST_LIMIT``."""
    return CheckpointError(
        f"{where} is {size} bytes, more than a manifest may hold (MANIFEST_LIMIT, {MANIFEST_LIMIT // 2**20} MiB): "
        "not a manifest shardavg wrote"
    )


def read_manifest_bytes(name: str | Path, dir_fd: int | None = None, where: str | Path | None = None) -> bytes:
    """A manifest's bytes: a regular file (never a link), at most ``MANIFEST_LIMIT`` bytes, its
    size checked before anything is read. A missing one raises FileNotFoundError."""
    where = name if where is None else where
    return read_bounded(name, MANIFEST_LIMIT, lambda size: manifest_too_large(str(where), size), dir_fd, where)


def _parsed_manifest(meta: Any, where: str) -> Description:
    meta = _checked_description(meta, where)
    version = meta["version"]
    if version >= 2 and "sequence" not in meta:
        raise invalid(where, "lacks 'sequence'")
    files, digests = _files(meta, where) if version >= 6 else (meta.get("files"), meta.get("digests"))
    if not isinstance(files, list) or not all(isinstance(f, str) and CHECKPOINT_FILE.match(f) for f in files):
        raise invalid(where, f"'files' must list rank-NNNNN-of-NNNNN.safetensors names, got {str(files)[:200]}")
    if not files or MANIFEST in files or len(set(files)) != len(files):
        raise invalid(where, f"'files' must list the shard files, each once, got {str(files)[:200]}")
    if version >= 4:
        _check_digests(meta.get("save_id"), digests, len(files), where)
        _check_sizes(meta["tensors"], sum(d["bytes"] for d in digests), where)
    grids = _grids(meta, len(files), where) if version >= 6 else []
    layouts = []
    for entry in meta["tensors"]:
        name, shape = entry["name"], tuple(entry["shape"])
        if version >= 6 and "layout" in entry:
            layouts.append(_layout(entry["layout"], name, shape, grids, where))
        else:
            chunks = _chunks(entry.get("chunks"), name, shape, len(files), version, where)
            layouts.append(_listed(shape, chunks, len(files)))
    saved = {}  # since version 4: the save's id and each file's size and hash
    if version >= 4:
        saved = {"save_id": meta["save_id"], "digests": tuple(FileDigest(d["bytes"], d["sha256"]) for d in digests)}
    return _typed(meta, layouts, files=tuple(files), sequence=meta.get("sequence"), **saved)


def _files(meta: dict[str, Any], where: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Version 6 spells the files as their count (file ``r`` is rank ``r``'s, named by
    ``shard_file``) and each digest as ``[bytes, sha256]``, so the per-rank part of a manifest is
    its smallest; read back as earlier versions spell them."""
    count, digests = meta.get("files"), meta.get("digests")
    if not is_count(count, 1):
        raise invalid(where, f"'files' must be the number of shard files, got {str(count)[:200]}")
    if not (isinstance(digests, list) and all(isinstance(d, list) and len(d) == 2 for d in digests)):
        raise invalid(where, f"'digests' must give each file's [bytes, sha256], got {str(digests)[:200]}")
    if count != len(digests):  # (before a name is made for each: the count is anyone's number)
        raise invalid(where, f"'files' says {count} files, 'digests' gives {len(digests)}: each file has one")
    return [shard_file(rank, count) for rank in range(count)], [{"bytes": size, "sha256": sha} for size, sha in digests]


def _check_digests(save_id: Any, digests: Any, files: int, where: str) -> None:
    if not (isinstance(save_id, str) and SAVE_ID.match(save_id)):
        raise invalid(where, f"'save_id' must be 32 hex digits, got {str(save_id)[:80]!r}")
    if not (
        isinstance(digests, list)
        and len(digests) == files
        and all(
            isinstance(d, dict)
            and set(d) == {"bytes", "sha256"}
            and is_count(d["bytes"])
            and isinstance(d["sha256"], str)
            and SHA256.match(d["sha256"])
            for d in digests
        )
    ):
        raise invalid(where, f"'digests' must give each file's bytes and sha256, got {str(digests)[:200]}")


def _check_sizes(tensors: list[dict[str, Any]], stored: int, where: str) -> None:
    """Every tensor is stored in the files (each average of it, once), so none can need more bytes
    than the ``stored`` bytes the digests give them: a shape is checked against them before any
    layout of it is worked out or any tensor of it allocated."""
    for entry in tensors:
        size = math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize
        if size > stored:
            raise invalid(
                where, f"tensor {entry['name']!r} of shape {entry['shape']} needs {size} bytes, more than the "
                f"{stored} bytes of the checkpoint's files",
            )  # fmt: skip


def _grids(meta: dict[str, Any], files: int, where: str) -> list[Grid]:
    """The manifest's grids of ranks: a shape, and the ranks (files) row-major, 0 .. n-1 when left
    out. A grid's distinct ranks are files, so its size is checked against theirs before its ranks
    are looked at."""
    grids = meta.get("grids")
    if not isinstance(grids, list):
        raise invalid(where, f"'grids' must be a list, got {str(grids)[:200]}")
    parsed = []
    for grid in grids:
        shape = grid.get("shape") if isinstance(grid, dict) else None
        good = (
            isinstance(shape, list)
            and 0 < len(shape) <= GRID_DIMS
            and all(is_count(size, 1) and size <= files for size in shape)
            and math.prod(shape) <= files
            and set(grid) <= {"shape", "ranks"}
        )
        ranks = grid.get("ranks", range(math.prod(shape))) if good else None
        if not (
            good and isinstance(ranks, (list, range)) and len(ranks) == math.prod(shape)
            and all(is_count(r) and r < files for r in ranks) and len(set(ranks)) == len(ranks)
        ):  # fmt: skip
            raise invalid(
                where, f"a grid must give a shape and as many distinct ranks below {files}, in at most {GRID_DIMS} "
                f"dims: {str(grid)[:200]}",
            )  # fmt: skip
        parsed.append(grid_from_json(grid))
    return parsed


def _layout(value: Any, name: str, shape: tuple[int, ...], grids: list[Grid], where: str) -> TensorLayout:
    """A tensor's layout from its JSON form, checked: a known grid, a placement per grid dim (or a
    flat partition along one), and owned parts that tile the tensor."""
    ndim = len(shape)
    grid = value.get("grid") if isinstance(value, dict) else None
    if not (is_count(grid) and grid < len(grids)) or set(value) - {"grid", "placements", "flat"}:
        raise invalid(where, f"tensor {name!r} has a malformed layout: {str(value)[:200]}")
    dims = len(grids[grid].shape)
    flat, placements = value.get("flat"), value.get("placements")
    if (flat is None) == (placements is None):
        raise invalid(where, f"tensor {name!r}: a layout has placements or a flat partition: {str(value)[:200]}")
    if flat is not None and not (
        isinstance(flat, dict) and set(flat) == {"dim", "chunk", "offset"}
        and is_count(flat["dim"]) and flat["dim"] < dims and is_count(flat["chunk"]) and is_count(flat["offset"])
    ):  # fmt: skip
        raise invalid(where, f"tensor {name!r} has a malformed flat partition: {str(flat)[:200]}")
    if placements is not None and not (
        isinstance(placements, list) and len(placements) == dims and all(_placement(p, ndim) for p in placements)
    ):
        raise invalid(where, f"tensor {name!r} has malformed placements for a {dims}-d grid: {str(placements)[:200]}")
    layout = layout_from_json(value, list(shape), grids)
    if isinstance(layout, MeshLayout):
        _check_cuts(layout, name, where)
    try:
        layout.check(name)
    except LayoutError as error:
        raise invalid(where, str(error)) from None
    return layout


def _check_cuts(layout: MeshLayout, name: str, where: str) -> None:
    """A split factor is a tensor-parallel degree (at most the grid's ranks) or the size of a dim
    folded into this one (at most its size); each rank's part is at most ``LAYOUT_BOXES`` boxes
    over all the parts: both checked before a part is worked out, which costs its boxes."""
    ranks = len(layout.grid.ranks)
    for placement in layout.placements:
        if placement[0] == "strided_shard" and placement[2] > max(layout.shape[placement[1]], ranks):
            raise invalid(
                where, f"tensor {name!r}: split factor {placement[2]} of dim {placement[1]} is more than both its size "
                f"{layout.shape[placement[1]]} and its grid's {ranks} rank(s)",
            )  # fmt: skip
    boxes = most_boxes(layout)
    if boxes > LAYOUT_BOXES:
        raise invalid(
            where, f"tensor {name!r}: its layout ({layout.shown()}) cuts it into up to {boxes} boxes, more than the "
            f"{LAYOUT_BOXES} shardavg reads (LAYOUT_BOXES)",
        )  # fmt: skip


def _placement(value: Any, ndim: int) -> bool:
    if value == ["replicate"]:
        return True
    if isinstance(value, list) and len(value) == 2 and value[0] == "shard":
        return is_count(value[1]) and value[1] < ndim
    return (
        isinstance(value, list) and len(value) == 3 and value[0] == "strided_shard"
        and is_count(value[1]) and value[1] < ndim and is_count(value[2], 1)
    )  # fmt: skip


def _listed(shape: tuple[int, ...], chunks: list[Chunk], files: int) -> ListedLayout:
    """A checked chunk table as the layout it describes: file ``f``'s part is its boxes, back to back."""
    blocks: list[list[Block]] = [[] for _ in range(files)]
    for c in chunks:
        blocks[c.file].append(Block(c.offsets, c.sizes, c.at, contiguous_strides(c.sizes)))
    parts = [Part(shape, tuple(held), sum(block.numel for block in held)) for held in blocks]
    return ListedLayout(shape, tuple(parts))


def _well_formed(chunk: Any, shape: tuple[int, ...], files: int, version: int) -> bool:
    """A chunk names one of the files, and a flat range (before version 5) or a box and its place."""
    if not (isinstance(chunk, dict) and is_count(chunk.get("file")) and chunk["file"] < files):
        return False
    if version < 5:
        start, end = chunk.get("start"), chunk.get("end")
        return is_count(start) and is_count(end) and start <= end <= math.prod(shape)
    return is_count(chunk.get("at")) and all(
        isinstance(chunk.get(key), list) and len(chunk[key]) == len(shape) and all(map(is_count, chunk[key]))
        for key in ("offsets", "sizes")
    )


def _chunks(table: Any, name: str, shape: tuple[int, ...], files: int, version: int, where: str) -> list[Chunk]:
    """A tensor's chunk table, checked: each chunk within the tensor, tiling it exactly, and each
    file's boxes back to back from its element 0. Before version 5 a chunk was a flat range
    ``{file, start, end}``: it is read as the boxes of that range."""
    if not isinstance(table, list) or not all(_well_formed(c, shape, files, version) for c in table):
        raise invalid(where, f"tensor {name!r} has a malformed chunk table: {str(table)[:200]}")
    if version < 5:
        chunks = [
            Chunk(c["file"], block.offsets, block.sizes, block.at)
            for c in table
            for block in Part.flat(shape, c["start"], c["end"]).blocks
        ]
    else:
        chunks = [Chunk(c["file"], tuple(c["offsets"]), tuple(c["sizes"]), c["at"]) for c in table]
    boxes = [(c.offsets, c.sizes) for c in chunks]
    if not tiles(shape, boxes):
        raise invalid(where, f"the chunks of {name!r} {boxes[:8]} do not cover its shape {list(shape)} exactly once")
    packed: dict[int, int] = {}  # each file's entry holds its boxes back to back, in the table's order
    for c in chunks:
        if c.at != packed.get(c.file, 0):
            raise invalid(where, f"tensor {name!r}: a chunk of file {c.file} starts at {c.at}, "
                                 f"expected {packed.get(c.file, 0)}")  # fmt: skip
        packed[c.file] = c.at + math.prod(c.sizes)
    return chunks


# ------------------------------------------------------------------------- provenance records

_TEXT = (str,)
_OPTIONAL_TEXT = (str, type(None))
_NUMBER = (int, float)
# A record's fields that shardavg reads back, and their types; any others are kept as they are.
_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "made": _TEXT, "shardavg": _TEXT, "torch": _TEXT, "python": _TEXT, "command": (list,), "inputs": (list,),
    "world_size": (int,), "writers": (int,), "step": (int, type(None)), "num_updates": (int, type(None)),
    "average": _OPTIONAL_TEXT, "schedule": _OPTIONAL_TEXT, "dtype": _OPTIONAL_TEXT, "strategy": _OPTIONAL_TEXT,
    "run_id": _OPTIONAL_TEXT, "sigma_rel": (*_NUMBER, type(None)),
}  # fmt: skip
_INPUT_FIELDS: dict[str, tuple[type, ...]] = {
    "path": _TEXT, "weight": _NUMBER, "step": (int, type(None)), "run_id": _OPTIONAL_TEXT,
    "profile": _OPTIONAL_TEXT, "manifest_sha256": _TEXT, "provenance": (dict, type(None)),
}  # fmt: skip
_REQUIRED = {"record": ("made", "shardavg"), "input": ("path", "weight")}


def check_provenance(record: Any, where: str) -> dict[str, Any]:
    """``record`` (parsed from ``where``) as shardavg writes a provenance record, or a
    ``ProvenanceError`` in one line naming ``where`` and the field at fault: at most
    ``PROVENANCE_DEPTH`` arrays and objects deep (so nothing that shows or rewrites it recurses
    without bound), ``made`` and ``shardavg`` given, each field shardavg reads of the type it
    writes, every input a path and a weight, nested inputs' records checked alike."""
    if nesting(record, PROVENANCE_DEPTH) > PROVENANCE_DEPTH:
        raise ProvenanceError(f"{where}: nested more than {PROVENANCE_DEPTH} levels deep (PROVENANCE_DEPTH)")
    _check_fields(record, "record", _RECORD_FIELDS, where, "")
    for index, entry in enumerate(record.get("inputs", [])):
        at = f"inputs[{index}]"
        _check_fields(entry, "input", _INPUT_FIELDS, where, at)
        if entry.get("provenance") is not None:
            check_provenance(entry["provenance"], f"{where} {at}.provenance")
    return record


def _check_fields(value: Any, kind: str, fields: dict[str, tuple[type, ...]], where: str, at: str) -> None:
    """One object of a record: an object, its required fields there, every field it has of its type."""
    place = f"{where} {at}".rstrip()
    if not isinstance(value, dict):
        raise ProvenanceError(f"{place}: a provenance {kind} must be an object, got {type(value).__name__}")
    missing = [key for key in _REQUIRED[kind] if key not in value]
    if missing:
        raise ProvenanceError(f"{place}: a provenance {kind} needs {missing}, has {sorted(value)[:12]}")
    for key, types in fields.items():
        found = value.get(key)
        if key in value and (isinstance(found, bool) or not isinstance(found, types)):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ProvenanceError(f"{place}: {key!r} must be {wanted}, got {type(found).__name__} {str(found)[:80]}")
    if "command" in value and not all(isinstance(word, str) for word in value["command"]):
        raise ProvenanceError(f"{place}: 'command' must be a list of strings, got {str(value['command'])[:80]}")
