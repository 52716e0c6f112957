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
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from typing import Any, get_args

from .errors import CheckpointError, LayoutError
from .options import BufferPolicy
from .parts import Block, Part, contiguous_strides, tiles
from .rules import rule_from_config
from .storage import DTYPES
from .strategies import ADAPTERS
from .tensor_layout import Grid, ListedLayout, TensorLayout, grid_from_json, layout_from_json
from .validate import AVERAGE_NAME, RUN_ID

FORMAT, VERSION = "shardavg", 6  # the description's format, shared by checkpoints, DCP and exports
# (2: checksummed; 3: "averages", several named averages, in place of one "rule"; 4: a checkpoint's
# manifest records its save's id and every file's size and SHA-256; 5: chunks are boxes of the
# tensor, not ranges of the flattened tensor, and DCP holds each tensor in its own shape; 6: a
# manifest gives each tensor's layout over the ranks, and the grids of ranks once, not its chunks)

MANIFEST = "shardavg.json"  # a checkpoint's description, chunk tables and files; written last
CHECKPOINT_FILE = re.compile(r"^(shardavg\.json|rank-\d{5}-of-\d{5}\.safetensors)$")
STEP_DIR = re.compile(r"^step-(\d+)$")  # a keep_last directory's checkpoints
SAVE_ID_KEY = "shardavg_save"  # in each shard's safetensors metadata: the save it belongs to
SAVE_ID = RUN_ID
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def shard_file(rank: int, world: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint written by ``world`` ranks."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def step_directory(step: int) -> str:
    """The name of a ``keep_last`` checkpoint of step ``step`` (nine digits: a billion steps sort)."""
    return f"step-{step:09d}"


def tensor_key(average: str | None, name: str) -> str:
    """The key a tensor of an average is saved under: its name, prefixed by the average's name for
    averaged tensors of a named average (``"slow/fc.weight"``)."""
    return name if average is None else f"{average}/{name}"


# ------------------------------------------------------------------------- the description


DESCRIBED = ("name", "aliases", "kind", "role", "shape", "dtype")  # a tensor entry's fields besides where it lies
KINDS = ("param", "buffer")
ROLES = ("average", "copy", "live")
CHECKSUM = "checksum"
REQUIRED = ("step", "num_updates", "num_skipped", "averages", "strategy", "world_size", "options", "tensors")
REQUIRED_V2 = tuple("rule" if key == "averages" else key for key in REQUIRED)


def fail(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}")


def is_count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def numel(shape: list[int]) -> int:
    return math.prod(shape)


def checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of the description without its checksum, in one canonical JSON spelling."""
    content = {key: value for key, value in meta.items() if key != CHECKSUM}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def with_checksum(meta: dict[str, Any]) -> dict[str, Any]:
    return meta | {CHECKSUM: checksum(meta)}


def _check_rule(config: Any, where: str) -> None:
    """A built-in rule's exact ``to_config()``, or a custom rule's name."""
    if isinstance(config, dict) and config.get("kind") == "custom":
        if set(config) != {"kind", "name"} or not isinstance(config["name"], str):
            raise fail(where, f"'rule' is not a custom rule's config: {str(config)[:200]}")
        return
    try:
        canonical = rule_from_config(config).to_config() if isinstance(config, dict) else None
    except (ValueError, TypeError, KeyError) as error:
        raise fail(where, f"'rule' {str(config)[:200]} is not a rule: {error!r}") from None
    if canonical != config:
        raise fail(where, f"'rule' {str(config)[:200]} is not a rule's config")


def _check_averages(averages: Any, where: str) -> None:
    """A non-empty list of ``{"name", "rule"}``: plain, distinct names, or one unnamed average."""
    if not isinstance(averages, list) or not averages:
        raise fail(where, f"'averages' must be a non-empty list, got {str(averages)[:200]}")
    for entry in averages:
        if not isinstance(entry, dict) or set(entry) != {"name", "rule"}:
            raise fail(where, f"an 'averages' entry must hold 'name' and 'rule', got {str(entry)[:200]}")
        _check_rule(entry["rule"], where)
    names = [entry["name"] for entry in averages]
    unnamed = names == [None]
    if not unnamed and not all(isinstance(n, str) and AVERAGE_NAME.match(n) for n in names):
        raise fail(where, f"average names {names} must be plain names, or one average with name null")
    if len(set(names)) != len(names):
        raise fail(where, f"average names {names} repeat")


def _check_options(options: Any, where: str) -> None:
    checks = {
        "every_n_steps": lambda value: is_count(value, 1),
        "start_step": is_count,
        "dtype": lambda value: value is None or (isinstance(value, str) and value in DTYPES),
        "buffers": lambda value: value in get_args(BufferPolicy),
        "include_frozen": lambda value: isinstance(value, bool),
    }
    if not isinstance(options, dict) or set(options) != set(checks):
        raise fail(where, f"'options' must hold {sorted(checks)}, got {str(options)[:200]}")
    wrong = [f"{key}={options[key]!r}" for key, valid in checks.items() if not valid(options[key])]
    if wrong:
        raise fail(where, f"'options' has invalid values: {', '.join(wrong)}")


def _check_tensor(entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise fail(where, f"a tensor entry is {type(entry).__name__}, not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise fail(where, f"a tensor entry has no name: {str(entry)[:200]}")
    aliases = entry.get("aliases")
    problems = []
    if not isinstance(aliases, list) or not all(isinstance(alias, str) and alias for alias in aliases):
        problems.append(f"aliases {aliases!r} are not a list of names")
    if entry.get("kind") not in KINDS:
        problems.append(f"kind {entry.get('kind')!r} is not one of {KINDS}")
    if entry.get("role") not in ROLES:
        problems.append(f"role {entry.get('role')!r} is not one of {ROLES}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(is_count(dim) for dim in shape):
        problems.append(f"shape {shape!r} is not a list of sizes")
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
        problems.append(f"dtype {entry.get('dtype')!r} is not one of {sorted(DTYPES)}")
    if problems:
        raise fail(where, f"tensor {name!r}: " + "; ".join(problems))


def check_description(meta: Any, where: str) -> dict[str, Any]:
    """Refuse anything that is not a complete, well-typed description written by a shardavg.

    Returns it with older versions' one ``"rule"`` given as ``"averages"``, as version 3 writes."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a shardavg checkpoint description")
    version = meta.get("version")
    if not is_count(version, 1) or version > VERSION:
        raise CheckpointError(f"{where} has format version {version!r}; this shardavg reads up to {VERSION}")
    if CHECKSUM in meta or version >= 2:
        if meta.get(CHECKSUM) != checksum(meta):
            raise fail(where, "the checksum does not match the content: the file was edited or damaged")
    required = ("step", "num_updates", "rule", "tensors") if version == 1 else REQUIRED_V2 if version == 2 else REQUIRED
    missing = [key for key in required if key not in meta]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    for key, minimum in (("step", 0), ("num_updates", 0), ("num_skipped", 0), ("world_size", 1)):
        if key in meta and not is_count(meta[key], minimum):
            raise fail(where, f"{key!r} must be an integer >= {minimum}, got {meta[key]!r}")
    if version < 3:  # one unnamed average, described by "rule"
        rule = meta["rule"]
        meta = {key: value for key, value in meta.items() if key != "rule"} | {
            "averages": [{"name": None, "rule": rule}]
        }
    _check_averages(meta["averages"], where)
    if "strategy" in meta and not (isinstance(meta["strategy"], str) and meta["strategy"] in ADAPTERS):
        raise fail(where, f"'strategy' must be one of {sorted(ADAPTERS)}, got {meta['strategy']!r}")
    if "options" in meta:
        _check_options(meta["options"], where)
    if "run" in meta and not (isinstance(meta["run"], str) and RUN_ID.match(meta["run"])):
        raise fail(where, f"'run' must be 32 hex digits, got {str(meta['run'])[:80]!r}")
    if "sequence" in meta and not is_count(meta["sequence"]):
        raise fail(where, f"'sequence' must be an integer >= 0, got {meta['sequence']!r}")
    if not isinstance(meta["tensors"], list):
        raise fail(where, "'tensors' must be a list")
    names: set[str] = set()
    for entry in meta["tensors"]:
        _check_tensor(entry, where)
        for name in (entry["name"], *entry["aliases"]):
            if name in names:
                raise fail(where, f"the name {name!r} appears twice")
            names.add(name)
    return meta


def encode_description(meta: dict[str, Any]) -> str:
    """The description as a JSON string, as DCP stores it: a plain ``str`` through ``torch.save``,
    which the offline reader loads back with ``weights_only=True`` (no Python objects)."""
    return json.dumps(with_checksum(meta))


def decode_description(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: 'meta' is {type(value).__name__}, not a shardavg description")
    try:
        meta = json.loads(value)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{where}: 'meta' is not valid JSON: {error}") from error
    return check_description(meta, where)


# ------------------------------------------------------------------------- the manifest and chunk tables


def chunk_table(chunks: Sequence[tuple[int, Part]]) -> list[dict[str, Any]]:
    """A tensor's chunks as a chunk table records them: each owner's boxes, back to back in its file."""
    return [
        {"file": owner, "offsets": list(block.offsets), "sizes": list(block.sizes), "at": block.at}
        for owner, part in chunks
        for block in part.packed().blocks
    ]


def saved_length(layout: TensorLayout, file: int) -> int:
    """Elements file ``file`` holds of a tensor: the part its rank owned, its boxes back to back."""
    return layout.part(file).numel


def check_chunk_table(meta: dict[str, Any], where: str) -> None:
    """The manifest's files are shardavg's own names (with their sizes, hashes and save id since
    version 4), and each tensor's layout (or chunk table) tiles it exactly; each entry's
    ``"layout"`` becomes its ``TensorLayout``."""
    if meta["version"] >= 2 and "sequence" not in meta:
        raise fail(where, "lacks 'sequence'")
    if meta["version"] >= 6:  # a count of the standard names, and each file's [bytes, sha256]
        _expand_files(meta, where)
    files = meta.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) and CHECKPOINT_FILE.match(f) for f in files):
        raise fail(where, f"'files' must list rank-NNNNN-of-NNNNN.safetensors names, got {str(files)[:200]}")
    if not files or MANIFEST in files or len(set(files)) != len(files):
        raise fail(where, f"'files' must list the shard files, each once, got {str(files)[:200]}")
    if meta["version"] >= 4:
        _check_digests(meta, files, where)
    grids = _grids(meta, len(files), where) if meta["version"] >= 6 else []
    for entry in meta["tensors"]:
        if meta["version"] >= 6 and "layout" in entry:
            entry["layout"] = _layout(entry, grids, where)
        else:
            chunks = _boxes(entry, len(files), meta["version"], where)
            entry["layout"] = _listed(entry["shape"], chunks, len(files))
            entry.pop("chunks")


def _grids(meta: dict[str, Any], files: int, where: str) -> list[Grid]:
    """The manifest's grids of ranks: a shape, and the ranks (files) row-major, 0 .. n-1 when left out."""
    grids = meta.get("grids")
    if not isinstance(grids, list):
        raise fail(where, f"'grids' must be a list, got {str(grids)[:200]}")
    parsed = []
    for grid in grids:
        shape = grid.get("shape") if isinstance(grid, dict) else None
        good = (
            isinstance(shape, list)
            and shape
            and all(is_count(size, 1) for size in shape)
            and set(grid) <= {"shape", "ranks"}
        )
        ranks = grid.get("ranks", range(numel(shape))) if good else None
        if not (
            good and isinstance(ranks, (list, range)) and len(ranks) == numel(shape)
            and all(is_count(r) and r < files for r in ranks) and len(set(ranks)) == len(ranks)
        ):  # fmt: skip
            raise fail(where, f"a grid must give a shape and as many distinct ranks below {files}: {str(grid)[:200]}")
        parsed.append(grid_from_json(grid))
    return parsed


def _layout(entry: dict[str, Any], grids: list[Grid], where: str) -> TensorLayout:
    """A tensor's layout from its JSON form, checked: a known grid, a placement per grid dim (or a
    flat partition along one), and owned parts that tile the tensor."""
    value, ndim, name = entry["layout"], len(entry["shape"]), entry["name"]
    grid = value.get("grid") if isinstance(value, dict) else None
    if not (is_count(grid) and grid < len(grids)) or set(value) - {"grid", "placements", "flat"}:
        raise fail(where, f"tensor {name!r} has a malformed layout: {str(value)[:200]}")
    dims = len(grids[grid].shape)
    flat, placements = value.get("flat"), value.get("placements")
    if (flat is None) == (placements is None):
        raise fail(where, f"tensor {name!r}: a layout has placements or a flat partition: {str(value)[:200]}")
    if flat is not None and not (
        isinstance(flat, dict) and set(flat) == {"dim", "chunk", "offset"}
        and is_count(flat["dim"]) and flat["dim"] < dims and is_count(flat["chunk"]) and is_count(flat["offset"])
    ):  # fmt: skip
        raise fail(where, f"tensor {name!r} has a malformed flat partition: {str(flat)[:200]}")
    if placements is not None and not (
        isinstance(placements, list) and len(placements) == dims and all(_placement(p, ndim) for p in placements)
    ):
        raise fail(where, f"tensor {name!r} has malformed placements for a {dims}-d grid: {str(placements)[:200]}")
    layout = layout_from_json(value, entry["shape"], grids)
    try:
        layout.check(name)
    except LayoutError as error:
        raise fail(where, str(error)) from None
    return layout


def _placement(value: Any, ndim: int) -> bool:
    if value == ["replicate"]:
        return True
    if isinstance(value, list) and len(value) == 2 and value[0] == "shard":
        return is_count(value[1]) and value[1] < ndim
    return (
        isinstance(value, list) and len(value) == 3 and value[0] == "strided_shard"
        and is_count(value[1]) and value[1] < ndim and is_count(value[2], 1)
    )  # fmt: skip


def _listed(shape: list[int], chunks: list[dict[str, Any]], files: int) -> ListedLayout:
    """A checked chunk table as the layout it describes: file ``f``'s part is its boxes, back to back."""
    blocks: list[list[Block]] = [[] for _ in range(files)]
    for c in chunks:
        blocks[c["file"]].append(Block(tuple(c["offsets"]), tuple(c["sizes"]), c["at"], contiguous_strides(c["sizes"])))
    parts = [Part(tuple(shape), tuple(held), sum(block.numel for block in held)) for held in blocks]
    return ListedLayout(tuple(shape), tuple(parts))


def _well_formed(chunk: Any, shape: list[int], files: int, version: int) -> bool:
    """A chunk names one of the files, and a flat range (before version 5) or a box and its place."""
    if not (isinstance(chunk, dict) and is_count(chunk.get("file")) and chunk["file"] < files):
        return False
    if version < 5:
        start, end = chunk.get("start"), chunk.get("end")
        return is_count(start) and is_count(end) and start <= end <= numel(shape)
    return is_count(chunk.get("at")) and all(
        isinstance(chunk.get(key), list) and len(chunk[key]) == len(shape) and all(map(is_count, chunk[key]))
        for key in ("offsets", "sizes")
    )


def _boxes(entry: dict[str, Any], files: int, version: int, where: str) -> list[dict[str, Any]]:
    """A tensor's chunk table as boxes ``{file, offsets, sizes, at}`` (the part of the tensor a file's
    entry holds from its element ``at``, row-major), checked: within the tensor, tiling it exactly,
    and each file's boxes back to back from its element 0. Before version 5 a chunk was a flat
    range ``{file, start, end}``: it is read as the boxes of that range."""
    shape, chunks = entry["shape"], entry.get("chunks")
    if not isinstance(chunks, list) or not all(_well_formed(c, shape, files, version) for c in chunks):
        raise fail(where, f"tensor {entry['name']!r} has a malformed chunk table: {str(chunks)[:200]}")
    if version < 5:
        chunks = [
            {"file": c["file"], "offsets": list(block.offsets), "sizes": list(block.sizes), "at": block.at}
            for c in chunks
            for block in Part.flat(shape, c["start"], c["end"]).blocks
        ]
    boxes = [(tuple(c["offsets"]), tuple(c["sizes"])) for c in chunks]
    if not tiles(shape, boxes):
        raise fail(
            where,
            f"the chunks of {entry['name']!r} {boxes[:8]} do not cover its shape {shape} exactly once",
        )
    packed: dict[int, int] = {}  # each file's entry holds its boxes back to back, in the table's order
    for c in chunks:
        if c["at"] != packed.get(c["file"], 0):
            raise fail(where, f"tensor {entry['name']!r}: a chunk of file {c['file']} starts at {c['at']}, "
                              f"expected {packed.get(c['file'], 0)}")  # fmt: skip
        packed[c["file"]] = c["at"] + numel(c["sizes"])
    return chunks


def _expand_files(meta: dict[str, Any], where: str) -> None:
    """Version 6 spells the files as their count (file ``r`` is rank ``r``'s, named by
    ``shard_file``) and each digest as ``[bytes, sha256]``, so the per-rank part of a manifest is
    its smallest; read back as earlier versions spell them."""
    count, digests = meta.get("files"), meta.get("digests")
    if not is_count(count, 1):
        raise fail(where, f"'files' must be the number of shard files, got {str(count)[:200]}")
    if not (isinstance(digests, list) and all(isinstance(d, list) and len(d) == 2 for d in digests)):
        raise fail(where, f"'digests' must give each file's [bytes, sha256], got {str(digests)[:200]}")
    meta["files"] = [shard_file(rank, count) for rank in range(count)]
    meta["digests"] = [{"bytes": size, "sha256": sha} for size, sha in digests]


def _check_digests(meta: dict[str, Any], files: list[str], where: str) -> None:
    if not (isinstance(meta.get("save_id"), str) and SAVE_ID.match(meta["save_id"])):
        raise fail(where, f"'save_id' must be 32 hex digits, got {str(meta.get('save_id'))[:80]!r}")
    digests = meta.get("digests")
    if not (
        isinstance(digests, list)
        and len(digests) == len(files)
        and all(
            isinstance(d, dict)
            and set(d) == {"bytes", "sha256"}
            and is_count(d["bytes"])
            and isinstance(d["sha256"], str)
            and SHA256.match(d["sha256"])
            for d in digests
        )
    ):
        raise fail(where, f"'digests' must give each file's bytes and sha256, got {str(digests)[:200]}")


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"cannot read {where}: {error}") from error
    meta = check_description(meta, where)
    check_chunk_table(meta, where)
    return meta
