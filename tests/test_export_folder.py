"""An export's folder as its readers see it: each export's own file names and id, a reader of the
index during a re-export, names in the way refused before anything is committed, a writer that
is handed another export's temporary file."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import trained

import shardavg.output.weight_files
from shardavg import CheckpointError, ExportError
from shardavg.checkpoints.storage import Entry
from shardavg.output.model_folder import folder_export_id
from shardavg.output.record import FolderRecord
from shardavg.output.weight_files import EXPORT_ID, Slots, WeightPlan, check_one_export, create_staged

INDEX = "model.safetensors.index.json"
SPLIT = 300  # bytes per file: TiedNet's export in several files


def metadata(path: Path) -> dict[str, str]:
    """A safetensors file's ``__metadata__`` (FileNotFoundError where it is gone)."""
    with open(path, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        return json.loads(handle.read(length))["__metadata__"]


def updates_of(path: Path) -> int:
    return json.loads(metadata(path)["shardavg"])["num_updates"]


def weight_files(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.is_symlink()}


def test_a_split_export_names_its_files_by_its_own_id_and_replaces_the_previous_ones(trainer, tmp_path) -> None:
    averager = trained(trainer)
    out = tmp_path / "export"
    ids = []
    for _ in range(2):
        averager.export(out, max_shard_size=SPLIT)
        index = json.loads((out / INDEX).read_text())
        names = sorted(set(index["weight_map"].values()))
        export_id = index["metadata"][EXPORT_ID]
        assert re.fullmatch("[0-9a-f]{12}", export_id)
        assert names == [f"model-{export_id}-{k:05d}-of-{len(names):05d}.safetensors" for k in range(1, len(names) + 1)]
        assert len(names) > 2 and {metadata(out / name)[EXPORT_ID] for name in names} == {export_id}
        assert sorted(os.listdir(out)) == sorted([*names, INDEX, "provenance.json"])  # the previous export's: gone
        assert folder_export_id(out) == export_id
        ids.append(export_id)
        trainer.step()
        averager.update()
    assert ids[0] != ids[1]
    averager.export(out)  # one file again: model.safetensors, the split export's files removed
    assert sorted(os.listdir(out)) == ["model.safetensors", "provenance.json"]
    assert folder_export_id(out) == metadata(out / "model.safetensors")[EXPORT_ID] not in ids


def test_a_reader_of_the_previous_index_gets_the_previous_files_or_none_during_the_commit(
    trainer, tmp_path, monkeypatch
) -> None:
    """A reader that read the index before the re-export and reads its files after each rename of
    the commit gets the previous export's files whole (before the new index, when they go: none)."""
    averager = trained(trainer)
    out = averager.export(tmp_path / "export", max_shard_size=SPLIT)
    before = updates_of(out / weight_files(out)[0])
    held_index = weight_files(out)
    trainer.step()
    averager.update()
    seen: list[list[int | None]] = []
    real_commit = shardavg.output.weight_files.commit_file

    def commit_then_read(path: Path) -> None:
        real_commit(path)
        found = []
        for name in held_index:
            try:
                found.append(updates_of(out / name))
            except FileNotFoundError:
                found.append(None)
        seen.append(found)

    monkeypatch.setattr(shardavg.output.weight_files, "commit_file", commit_then_read)
    averager.export(out, max_shard_size=SPLIT)
    assert len(seen) == len(held_index) + 2  # every weight file, the index, the provenance
    assert all(found == [before] * len(held_index) for found in seen), seen  # never a mix
    assert updates_of(out / weight_files(out)[0]) == before + 1


def read_in_a_loop(out: Path, stop: Any, results: Any) -> None:
    """Another program's loads, Transformers' way (the index, then each file it names), until
    ``stop`` is set: each load's set of update counts, and how many found their files gone."""
    loads, gone = [], 0
    try:
        while not stop.is_set() and len(loads) < 20_000:
            try:
                index = json.loads((out / INDEX).read_text())
                loads.append(sorted({updates_of(out / name) for name in sorted(set(index["weight_map"].values()))}))
            except FileNotFoundError:  # the files of the index read were removed by the next commit
                gone += 1
    finally:
        results.send((loads, gone))


def test_a_reader_looping_over_the_index_and_its_files_during_re_exports_never_mixes_two(trainer, tmp_path) -> None:
    averager = trained(trainer)
    out = averager.export(tmp_path / "export", max_shard_size=SPLIT)
    context = multiprocessing.get_context("fork")
    stop, (received, sent) = context.Event(), context.Pipe(duplex=False)
    reader = context.Process(target=read_in_a_loop, args=(out, stop, sent))
    reader.start()
    try:
        for _ in range(20):
            trainer.step()
            averager.update()
            averager.export(out, max_shard_size=SPLIT)
    finally:
        stop.set()
        assert received.poll(60), "the reader did not report"
        loads, _ = received.recv()
        reader.join(timeout=60)
    mixed = [found for found in loads if len(found) != 1]
    assert loads and not mixed, f"{len(mixed)} of {len(loads)} loads mixed exports: {mixed[:3]}"
    assert len({found[0] for found in loads}) > 1  # the reader saw several exports


def test_files_of_two_exports_are_refused_by_their_ids(trainer, tmp_path) -> None:
    averager = trained(trainer)
    out = averager.export(tmp_path / "export", max_shard_size=SPLIT)
    first = weight_files(out)[0]
    stale = (out / first).read_bytes()
    trainer.step()
    averager.update()
    averager.export(out, max_shard_size=SPLIT)
    (out / weight_files(out)[0]).write_bytes(stale)  # a file of the first export under the second's name
    index_id = json.loads((out / INDEX).read_text())["metadata"][EXPORT_ID]
    stale_id = metadata(out / weight_files(out)[0])[EXPORT_ID]
    with pytest.raises(CheckpointError) as refused:
        folder_export_id(out)
    assert str(refused.value) == (
        f"{out / weight_files(out)[0]} holds export {stale_id}, {out / INDEX} export {index_id}: files of two "
        "exports (the folder was re-exported while it was read); read it again once the export has finished"
    )
    with pytest.raises(CheckpointError, match="a.safetensors holds no export id, index export abc"):
        check_one_export([("index", {EXPORT_ID: "abc"}), ("a.safetensors", {"format": "pt"})])
    assert check_one_export([("index", {"total_size": 1}), ("a.safetensors", None)]) is None  # older exports


IN_THE_WAY = "{path} is in the way of a temporary file shardavg writes and is not a regular file (a link?): "
IN_THE_WAY += "shardavg will not write through it; move it"


@pytest.mark.parametrize(
    "name, split, message",
    [
        (".provenance.json.incomplete", False, IN_THE_WAY),
        (".provenance.json.incomplete", True, IN_THE_WAY),
        (
            f".{INDEX}.incomplete",
            True,
            "{out} holds weight files shardavg did not write (.{index}.incomplete): they would be replaced; "
            "export into another folder, or move them",
        ),
    ],
)
def test_a_link_at_a_name_the_export_writes_is_refused_before_anything_is_committed(
    trainer, tmp_path, name, split, message
) -> None:
    averager = trained(trainer)
    size = SPLIT if split else "5GB"
    out = averager.export(tmp_path / "export", max_shard_size=size)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not the export's")
    (out / name).symlink_to(target)
    before = contents(out)
    trainer.step()
    averager.update()
    with pytest.raises(ExportError) as refused:
        averager.export(out, max_shard_size=size)
    assert str(refused.value) == message.format(path=out / name, out=out, index=INDEX)
    assert contents(out) == before and target.read_bytes() == b"not the export's"  # the previous export, whole
    assert sorted(os.listdir(out)) == sorted([*before, name])


def test_a_writer_refuses_a_temporary_file_another_export_created(tmp_path) -> None:
    """What a rank sees where its OUT is not rank 0's (a node-local disk): an earlier export's
    leftover under the temporary name. It is refused before a byte is written."""
    entries = [Entry("w", torch.float32, (4, 3))]
    earlier = WeightPlan(entries, 2**30, FolderRecord("export"), "a" * 12)
    create_staged(tmp_path, earlier)
    left = (tmp_path / ".model.safetensors.incomplete").read_bytes()
    slots = Slots(tmp_path, earlier.with_id("b" * 12))
    with pytest.raises(ExportError) as refused:
        slots.write(slots.plan.slots[0], torch.ones(4, 3))
    slots.close()
    assert str(refused.value) == (
        f"{tmp_path / '.model.safetensors.incomplete'} is not this export's file (another export's leftover): "
        f"rank 0 does not share {tmp_path} with the committer (rank 0): each sees its own folder at that path "
        "(a node-local disk?); export into a folder on a file system every rank sees, or with writers=1"
    )
    assert (tmp_path / ".model.safetensors.incomplete").read_bytes() == left
    Slots(tmp_path, earlier).write(earlier.slots[0], torch.ones(4, 3))  # its own export's file: written
    assert (tmp_path / ".model.safetensors.incomplete").read_bytes()[-48:] == torch.ones(12).numpy().tobytes()


def test_transformers_loads_a_split_export_with_its_own_names(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=67, n_positions=16, n_embd=12, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    from shardavg import EMA, WeightAverager

    averager = WeightAverager(model, EMA(decay=0.9))
    averager.update()
    out = averager.export(tmp_path / "gpt2", max_shard_size=2000)
    config.save_pretrained(out)
    assert len(weight_files(out)) > 2
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mis-shaped
    reference = averager.full_state_dict()
    got = loaded.state_dict()
    assert all(torch.equal(got[name], reference[name]) for name in reference)
