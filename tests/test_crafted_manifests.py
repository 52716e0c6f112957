"""Crafted manifests whose counts would exhaust memory or never end: each refused in one line,
before anything is allocated or looped over.

A manifest is anyone's file: the number of files, a layout's split factor, a tensor's shape, the
manifest's own size and a shard header's shapes are all counts that drive a loop or an
allocation. Each case runs ``avg.load``, ``shardavg inspect`` and ``shardavg export`` in one child
process whose address space is limited to ``ADDRESS_SPACE`` (an unbounded loop or allocation fails
there instead of taking the machine), each call under a deadline of ``DEADLINE`` seconds (a bound
that only a loop over a crafted count reaches; no speed is asserted). Checksums are recomputed,
as someone who knows the format would, so each bound is reached on its own.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import trained

from shardavg.checkpoints.description import with_checksum

ADDRESS_SPACE = 2 * 2**30  # bytes the child may map: torch and the test model need about 1 GiB
DEADLINE = 5  # seconds each call may take in the child
SHARD = "rank-00000-of-00001.safetensors"
UP = "block.up.weight"  # 10 x 6, saved whole by the one rank

CHILD = """
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from helpers import deadline, fresh
from shardavg import CheckpointError
from shardavg.cli import main

def run(call):
    try:
        with deadline(int(sys.argv[4])):
            return call()
    except BaseException as error:  # (a MemoryError, a TimeoutError: what a bound is for)
        return f"{type(error).__name__}: {str(error)[:300]}"

def load(path):
    try:
        fresh().load(path)
    except CheckpointError as error:
        return str(error)
    return "loaded"

def cli(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return [code, err.getvalue()]

for path in sys.argv[5:]:
    print(json.dumps({"path": path, "load": run(lambda: load(path)), "inspect": run(lambda: cli("inspect", path)),
                      "export": run(lambda: cli("export", path, path + "-export"))}), flush=True)
"""


def craft(path: Path, mutate: Callable[[dict], None]) -> None:
    """Edit the manifest at ``path`` and recompute its checksum."""
    meta = json.loads((path / "shardavg.json").read_text())
    mutate(meta)
    meta.pop("checksum", None)
    (path / "shardavg.json").write_text(json.dumps(with_checksum(meta)))


def tensor(meta: dict, name: str) -> dict:
    return next(entry for entry in meta["tensors"] if entry["name"] == name)


def in_a_bounded_child(paths: list[Path]) -> dict[str, dict]:
    """What the child made of each checkpoint: the load's error, inspect's and export's exit code and stderr."""
    tests = Path(__file__).resolve().parent
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ADDRESS_SPACE), str(tests), str(tests.parent / "tests_distributed"),
         str(DEADLINE), *map(str, paths)],
        capture_output=True, text=True, timeout=60 + 3 * DEADLINE * len(paths),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {Path(found["path"]).name: found for found in map(json.loads, done.stdout.splitlines())}


def sparse_manifest(path: Path, size: int) -> None:
    """A manifest of ``size`` bytes that takes no room on disk: a hole after a valid start."""
    with open(path / "shardavg.json", "r+b") as handle:
        handle.truncate(size)


def huge_shapes_in_the_header(path: Path) -> None:
    """A shard whose header gives a tensor 200,000 dims of 2**62: multiplying them out is minutes."""
    header = json.dumps({"gain": {"dtype": "F32", "shape": [2**62] * 200_000, "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    (path / SHARD).write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "files": (
        lambda path: craft(path, lambda meta: meta.__setitem__("files", 10**8)),
        r"'files' says 100000000 files, 'digests' gives 1: each file has one",
    ),
    "split-factor": (
        lambda path: craft(
            path, lambda meta: tensor(meta, UP)["layout"].__setitem__("placements", [["strided_shard", 0, 10**12]])
        ),
        rf"tensor '{UP}': split factor 1000000000000 of dim 0 is more than both its size 10 and its grid's 1 rank\(s\)",
    ),
    "boxes": (  # a split factor within its dim, the files claiming bytes enough: the boxes it cuts
        lambda path: craft(
            path,
            lambda meta: (
                tensor(meta, UP).update(shape=[2**23], layout={"grid": 0, "placements": [["strided_shard", 0, 2**23]]}),
                meta["digests"][0].__setitem__(0, 2**40),
            ),
        ),
        rf"tensor '{UP}': its layout \(.*\) cuts it into up to 8388608 boxes, more than the 4194304 shardavg reads "
        r"\(LAYOUT_BOXES\)",
    ),
    "shape": (
        lambda path: craft(path, lambda meta: tensor(meta, UP).__setitem__("shape", [10**12, 10**12])),
        rf"tensor '{UP}' of shape \[1000000000000, 1000000000000\] needs 4000000000000000000000000 bytes, more than "
        r"the \d+ bytes of the checkpoint's files",
    ),
    "dims": (
        lambda path: craft(path, lambda meta: tensor(meta, UP).__setitem__("shape", [1] * 100_000)),
        rf"tensor '{UP}': shape \[1, 1, .* is not a list of at most 64 sizes",
    ),
    "grid": (
        lambda path: craft(path, lambda meta: meta["grids"].__setitem__(0, {"shape": [10**6, 10**6]})),
        r"a grid must give a shape and as many distinct ranks below 1, in at most 16 dims",
    ),
    "manifest-size": (
        lambda path: sparse_manifest(path, 3 * 2**30),
        r"shardavg.json is 3221225472 bytes, more than a manifest may hold \(MANIFEST_LIMIT, 256 MiB\)",
    ),
    "header-shape": (
        huge_shapes_in_the_header,
        rf"{SHARD} is not a readable safetensors file \(truncated or foreign\?\): 'gain': shape \[4611686018427387904, "
        r".* holds more elements than the file has bytes",
    ),
}


def test_crafted_counts_are_refused_in_one_line_before_they_cost_anything(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    paths = []
    for label, (mutate, _) in CASES.items():
        path = averager.save(tmp_path / label)
        mutate(path)
        paths.append(path)
    run_dir = tmp_path / "run"  # a keep_last folder: the newest save is found by reading each manifest
    newest = averager.save(run_dir, keep_last=2)
    sparse_manifest(newest, 3 * 2**30)
    paths.append(run_dir)
    found = in_a_bounded_child(paths)
    expected = {label: match for label, (_, match) in CASES.items()} | {"run": CASES["manifest-size"][1]}
    for label, match in expected.items():
        got = found[label]
        assert re.search(match, got["load"]), f"{label}: load: {got['load']}"
        for command in ("inspect", "export"):
            assert isinstance(got[command], list), f"{label}: {command}: {got[command]}"
            code, err = got[command]
            assert code == 2 and err.startswith("shardavg: error:") and len(err.strip().splitlines()) == 1, (label, err)
            assert re.search(match, err), f"{label}: {command}: {err}"
        assert not (tmp_path / f"{label}-export").exists(), label


def strided_rows(size: int, split_factor: int, count: int, index: int) -> list[int]:
    """The rows a ``_StridedShard(0, split_factor)`` over ``count`` ranks gives rank ``index``, as
    DTensor cuts them: ``torch.chunk`` in ``split_factor``, each piece in ``count``, the index-th of each."""
    import torch

    rows: list[int] = []
    for piece in torch.arange(size).chunk(split_factor):
        cut = piece.chunk(count)
        rows += cut[index].tolist() if index < len(cut) else []
    return rows


@pytest.mark.parametrize("split_factor", [1, 6, 10, 12])
def test_a_split_factor_up_to_the_dims_size_or_the_ranks_cuts_as_torch_does(split_factor: int) -> None:
    """Within the bound, a layout's parts are DTensor's (a factor beyond the dim's 10 rows cuts it
    into single rows, as 10 does: no more pieces are worked out than rows), and the owned parts
    tile the tensor."""
    from shardavg.layouts.tensor_layout import MeshLayout, make_grid

    layout = MeshLayout((10, 3), make_grid((12,), range(12)), (("strided_shard", 0, split_factor),))
    layout.check("t")
    for rank in range(12):
        blocks = layout.part(rank).blocks
        got = [row for block in blocks for row in range(block.offsets[0], block.offsets[0] + block.sizes[0])]
        assert got == strided_rows(10, split_factor, 12, rank), rank


def test_a_bounded_read_refuses_what_is_past_its_limit_or_not_a_file(tmp_path) -> None:
    from shardavg.base.errors import CheckpointError
    from shardavg.checkpoints.storage import read_bounded

    def too_large(size: int) -> CheckpointError:
        return CheckpointError(f"{size} bytes")

    path = tmp_path / "small.json"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, 10, too_large) == b"x" * 10
    with pytest.raises(CheckpointError, match="^10 bytes$"):
        read_bounded(path, 9, too_large)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CheckpointError, match="is not a regular file"):
        read_bounded(tmp_path / "fifo", 9, too_large)
