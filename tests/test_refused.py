"""Damaged or crafted checkpoints are refused with one clear error, before anything changes.

"Crafted" manifests here are edited as someone who knows the format would: the checksum is
recomputed, so each check behind it is exercised on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import as_chunk_tables, as_flat_ranges, deadline, fresh, replace_shard, trained
from safetensors.torch import load_file

from shardavg import CheckpointError, WeightAverager
from shardavg.checkpoints.description import with_checksum
from shardavg.cli import main as cli_main

SHARD = "rank-00000-of-00001.safetensors"
HUGE = 10**24  # elements: no allocator could serve it


def craft(path: Path, mutate: Callable[[dict], None]) -> None:
    """Edit the manifest at ``path`` and recompute its checksum."""
    meta = json.loads((path / "shardavg.json").read_text())
    mutate(meta)
    for entry in meta["tensors"] if isinstance(meta.get("tensors"), list) else []:
        if isinstance(entry, dict) and "chunks" in entry:  # a chunk table given replaces the layout
            entry.pop("layout", None)
    meta.pop("checksum", None)
    (path / "shardavg.json").write_text(json.dumps(with_checksum(meta)))


def tensor(meta: dict, name: str) -> dict:
    return next(entry for entry in meta["tensors"] if entry["name"] == name)


def cli_refuses(args: list[str], match: str, capsys) -> str:
    """The CLI ends with exit code 2 and one line on stderr that says what is wrong: that line."""
    with deadline(20):
        code = cli_main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shardavg: error:") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err
    return err.strip()


def refused_everywhere(path: Path, match: str, capsys) -> None:
    """``load`` raises a CheckpointError and leaves the averager as it was; the CLI's inspect or
    export end with one line on stderr and exit code 2, writing nothing."""
    averager = fresh()
    shadows = [s.clone() if s is not None else None for s in averager.shadows()]
    with deadline(20), pytest.raises(CheckpointError, match=match):
        averager.load(path)
    assert (averager.step, averager.num_updates) == (0, 0)
    assert all(a is None or torch.equal(a, b) for a, b in zip(shadows, averager.shadows()))
    cli_refuses(["export", str(path), str(path.parent / f"{path.name}-export")], match, capsys)
    assert not (path.parent / f"{path.name}-export").exists()


def test_an_edited_manifest_fails_its_checksum(trainer, tmp_path, capsys) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    text = (path / "shardavg.json").read_text()
    edited = re.sub(r'"step":\s*(\d+)', lambda m: f'"step": {int(m.group(1)) + 1}', text)
    assert edited != text
    (path / "shardavg.json").write_text(edited)
    refused_everywhere(path, "the checksum does not match the content", capsys)


def test_layouts_that_do_not_describe_the_tensor_are_refused(trainer, tmp_path, capsys) -> None:
    """Format 6: a layout naming a grid that is not there, placements that do not fit it or the
    tensor, a flat partition that stops short, grids of ranks with no file, or the files and
    digests spelt any other way: each refused by name before anything is read."""
    averager = trained(trainer, steps=3)
    up = "block.up.weight"  # 10 x 6, saved whole by the one rank
    cases = {
        "no grid": (
            lambda meta: tensor(meta, up)["layout"].__setitem__("grid", 5),
            rf"tensor '{up}' has a malformed layout",
        ),
        "placements": (
            lambda meta: tensor(meta, up)["layout"].__setitem__("placements", [["shard", 2]]),
            rf"tensor '{up}' has malformed placements for a 1-d grid",
        ),
        "two rules": (
            lambda meta: tensor(meta, up)["layout"].__setitem__("flat", {"dim": 0, "chunk": 60, "offset": 0}),
            "a layout has placements or a flat partition",
        ),
        "flat short": (
            lambda meta: tensor(meta, up).__setitem__(
                "layout", {"grid": 0, "flat": {"dim": 0, "chunk": 59, "offset": 0}}
            ),
            rf"the shards of '{up}' \(shape \(10, 6\)\) do not tile it",
        ),
        "grid ranks": (
            lambda meta: meta["grids"].__setitem__(0, {"shape": [2]}),
            r"a grid must give a shape and as many distinct ranks below 1",
        ),
        "files": (
            lambda meta: meta.__setitem__("files", ["rank-00000-of-00001.safetensors"]),
            "'files' must be the number",
        ),
        "digests": (
            lambda meta: meta.__setitem__("digests", [{"bytes": 1, "sha256": "0" * 64}]),
            r"'digests' must give each file's \[bytes, sha256\]",
        ),
    }
    for label, (mutate, match) in cases.items():
        path = averager.save(tmp_path / label)
        craft(path, mutate)
        refused_everywhere(path, match, capsys)


def test_partial_empty_and_overlapping_chunk_tables_are_refused(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)

    uncovered = r"the chunks of 'block.up.weight' .* do not cover its shape \[10, 6\] exactly"

    def box(offsets, sizes, at=0):
        return {"file": 0, "offsets": offsets, "sizes": sizes, "at": at}

    for label, chunks in {  # block.up.weight is 10 x 6
        "empty": [],
        "partial": [box([0, 0], [5, 6])],
        "columns short": [box([0, 0], [10, 3]), box([0, 3], [10, 2], at=30)],
        "overlapping": [box([0, 0], [10, 6]), box([5, 0], [5, 6], at=60)],
        "beyond": [box([0, 0], [11, 6])],
    }.items():
        path = averager.save(tmp_path / label)
        craft(path, lambda meta, chunks=chunks: tensor(meta, "block.up.weight").__setitem__("chunks", chunks))
        refused_everywhere(path, uncovered, capsys)
    for label, chunks in {  # the flat ranges of format version 4 and before, still read, checked the same
        "v4 partial": [{"file": 0, "start": 0, "end": 30}],
        "v4 overlapping": [{"file": 0, "start": 0, "end": 60}, {"file": 0, "start": 30, "end": 60}],
    }.items():
        path = averager.save(tmp_path / label)

        def legacy(meta, chunks=chunks):
            meta.update(as_flat_ranges(meta, 4))
            tensor(meta, "block.up.weight")["chunks"] = chunks

        craft(path, legacy)
        refused_everywhere(path, uncovered, capsys)
    path = averager.save(tmp_path / "unpacked")  # a file's boxes must lie back to back in its entry
    craft(path, lambda meta: tensor(meta, "block.up.weight").__setitem__("chunks", [box([0, 0], [10, 6], at=1)]))
    refused_everywhere(path, r"'block.up.weight': a chunk of file 0 starts at 1, expected 0", capsys)


def test_the_offline_reader_checks_dtype_and_shape_like_load(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    path = averager.save(tmp_path / "ints")
    stored = load_file(str(path / SHARD))
    stored["gain"] = torch.zeros_like(stored["gain"], dtype=torch.int32)  # int32 bytes under an F32 entry
    replace_shard(path, SHARD, stored)
    refused_everywhere(path, r"'gain' is \('I32', \[1\]\), the manifest says \('F32', \[1\]\)", capsys)
    path = averager.save(tmp_path / "shape")
    craft(
        path,
        lambda meta: tensor(meta, "gain").update(
            shape=[2], chunks=[{"file": 0, "offsets": [0], "sizes": [2], "at": 0}]
        ),
    )
    with pytest.raises(CheckpointError, match=r"gain: checkpoint \(2,\) vs model \(1,\)"):
        fresh().load(path)
    cli_main(["export", str(path), str(tmp_path / "out")])
    assert "'gain' is ('F32', [1]), the manifest says ('F32', [2])" in capsys.readouterr().err


def test_files_outside_the_checkpoint_are_never_read(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    outside = averager.save(tmp_path / "elsewhere")
    for name in ("../elsewhere/" + SHARD, str(outside / SHARD), "shardavg.json"):
        path = averager.save(tmp_path / "ckpt")
        craft(path, lambda meta, name=name: as_chunk_tables(meta).__setitem__("files", [name]))  # names: before 6
        refused_everywhere(path, r"'files' must list", capsys)
    path = averager.save(tmp_path / "linked")
    os.replace(path / SHARD, tmp_path / "moved.safetensors")
    os.symlink(tmp_path / "moved.safetensors", path / SHARD)
    refused_everywhere(path, f"{path / SHARD} links to {tmp_path / 'moved.safetensors'}, outside {path}", capsys)


def dcp_checkpoint(averager: WeightAverager, path: Path, edit: Callable) -> Path:
    """A DCP checkpoint whose metadata ``edit(metadata)`` changed (DCP's own pickle, our own file)."""
    dcp.save({"ema": averager}, checkpoint_id=str(path), no_dist=True)
    with open(path / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # noqa: S301 - written just above by dcp.save
    edit(metadata)
    with open(path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return path


def storage_of(metadata, fqn: str):
    return next(index for index in metadata.storage_data if index.fqn == fqn)


def test_dcp_entries_are_checked_before_they_are_read(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    fqn = "ema.tensors.block.up.weight"

    def move(**changes):
        def edit(metadata):
            index = storage_of(metadata, fqn)
            metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)

        return edit

    for label, edit, match in (
        ("parent", move(relative_path="../elsewhere.distcp"), "is stored at '../elsewhere.distcp'"),
        ("absolute", move(relative_path="/etc/hostname"), "is stored at '/etc/hostname'"),
        ("huge", move(length=2 * 2**30), r"claims bytes .* of a \d+-byte file"),
    ):
        path = dcp_checkpoint(averager, tmp_path / label, edit)
        cli_refuses(["export", str(path), str(tmp_path / "out")], match, capsys)

    def drop_chunks(metadata):
        metadata.state_dict_metadata[fqn].chunks.clear()

    path = dcp_checkpoint(averager, tmp_path / "partial", drop_chunks)
    cli_refuses(["export", str(path), str(tmp_path / "out")], r"do not tile its shape \[10, 6\]", capsys)
    path = dcp_checkpoint(averager, tmp_path / "fifo", lambda metadata: None)
    for file in path.glob("*.distcp"):  # a pipe in place of the data file would block a reader forever
        file.unlink()
        os.mkfifo(file)
    cli_refuses(["inspect", str(path)], "is missing or not a regular file: refused", capsys)
    assert not (tmp_path / "out").exists()


class Planted:
    """A Python object of the test's own where shardavg expects tensors: unpickling it would leave
    a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def stored(path: Path, fqn: str):
    """Where DCP stored ``fqn`` in the checkpoint at ``path``: its storage info."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return metadata.storage_data[storage_of(metadata, fqn)]


def plant_in_data(path: Path, fqn: str, planted: Planted) -> Path:
    """Overwrite the bytes DCP stored for ``fqn`` with a pickle of ``planted``; returns the data file."""
    info = stored(path, fqn)
    data = bytearray((path / info.relative_path).read_bytes())
    evil = pickle.dumps(planted)  # (protocol 4: torch warns of it before refusing, which must not show)
    assert len(evil) <= info.length
    data[info.offset : info.offset + info.length] = evil.ljust(info.length, b".")
    (path / info.relative_path).write_bytes(bytes(data))
    return path / info.relative_path


def test_a_dcp_entry_holding_a_pickled_object_is_refused_in_one_line(trainer, tmp_path, capsys) -> None:
    """Where shardavg expects tensors, a DCP entry holds a pickled Python object (the averager's
    meta replaced by one when saved, or a tensor's bytes overwritten by one): inspect and export
    refuse it in one line naming the entry and its file, without running it and without torch's
    advice to load it again with ``weights_only=False``."""
    averager = trained(trainer, steps=3)
    marker = tmp_path / "unpickled"
    meta = tmp_path / "meta"
    dcp.save({"ema": averager.state_dict() | {"meta": Planted(marker)}}, checkpoint_id=str(meta), no_dist=True)
    meta_file = meta / stored(meta, "ema.meta").relative_path
    weight = tmp_path / "weight"
    dcp.save({"ema": averager}, checkpoint_id=str(weight), no_dist=True)
    weight_file = plant_in_data(weight, "ema.tensors.block.up.weight", Planted(marker))
    refusal = "it holds pickled Python objects, not tensor data; shardavg never unpickles Python objects"
    cases = [
        (["inspect", str(meta)], "ema.meta", meta_file),
        (["export", str(meta), str(tmp_path / "out")], "ema.meta", meta_file),
        (["export", str(weight), str(tmp_path / "out")], "ema.tensors.block.up.weight", weight_file),
    ]  # (inspect reads no tensor data)
    for args, fqn, file in cases:
        with warnings.catch_warnings(record=True) as warned:  # (a warning would be more lines on stderr)
            warnings.simplefilter("always")
            said = cli_refuses(args, re.escape(fqn), capsys)
        assert said == f"shardavg: error: cannot read {fqn} from {file}: {refusal}", said
        assert "weights_only" not in said and not warned, [str(w.message) for w in warned]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_load_state_dict_checks_everything_before_changing_anything(trainer, tmp_path) -> None:
    source = trained(trainer, steps=3)
    state = source.state_dict()
    target = fresh()
    target.update()
    shadows = [s.clone() if s is not None else None for s in target.shadows()]

    def unchanged() -> bool:
        same = all(a is None or torch.equal(a, b) for a, b in zip(shadows, target.shadows()))
        return same and (target.step, target.num_updates) == (1, 1)

    missing = {"meta": state["meta"], "tensors": {k: v for k, v in state["tensors"].items() if k != "gain"}}
    with pytest.raises(CheckpointError, match=r"describes \['gain'\] but its 'tensors' lack them"):
        target.load_state_dict(missing)
    assert unchanged()
    for key, value in (("step", "abc"), ("num_updates", -1), ("world_size", 0), ("num_skipped", 1.5)):
        meta = json.loads(state["meta"])
        meta[key] = value
        meta.pop("checksum")
        with pytest.raises(CheckpointError, match=rf"'{key}' must be an integer >= \d, got {value!r}"):
            target.load_state_dict({"meta": json.dumps(with_checksum(meta)), "tensors": state["tensors"]})
        assert unchanged()
    with pytest.warns(UserWarning, match=r"describes \['gain'\] but its 'tensors' lack them"):
        target.load_state_dict(missing, strict=False)
    assert target.num_updates == 3 and torch.equal(target.full_state_dict()["gain"], target.strategy.model.gain)


def test_cli_reports_malformed_input_in_one_line(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    cases: dict[str, tuple[Callable[[dict], None], str]] = {
        "nested": (None, "cannot read"),  # type: ignore[dict-item]
        "no-role": (lambda meta: tensor(meta, "gain").pop("role"), "role None is not one of"),
        "file-index": (
            lambda meta: tensor(meta, "gain").__setitem__(
                "chunks", [{"file": 3, "offsets": [0], "sizes": [1], "at": 0}]
            ),
            "malformed chunk table",
        ),
        "tensors-text": (lambda meta: meta.__setitem__("tensors", "abc"), "'tensors' must be a list"),
        "huge": (
            lambda meta: tensor(meta, "gain").update(
                shape=[10**12] * 2, chunks=[{"file": 0, "offsets": [0, 0], "sizes": [10**12] * 2, "at": 0}]
            ),
            r"tensor 'gain' of shape \[1000000000000, 1000000000000\] needs 4000000000000000000000000 bytes, "
            r"more than the \d+ bytes of the checkpoint's files",
        ),
    }
    for label, (mutate, match) in cases.items():
        path = averager.save(tmp_path / label)
        if mutate is None:
            (path / "shardavg.json").write_text("[" * 100_000 + "]" * 100_000)  # RecursionError in json
        else:
            craft(path, mutate)
        cli_refuses(["inspect", str(path)], match, capsys)  # (a huge shape too: checked against the files' bytes)
        cli_refuses(["export", str(path), str(tmp_path / "out")], match, capsys)
    fine = str(averager.save(tmp_path / "fine"))
    cli_refuses(["export", fine, str(tmp_path / "out"), "--max-shard-size", "9" * 400], "positive size", capsys)
    assert not (tmp_path / "out").exists()
