"""The record of how a model folder was made: one type, written by all four writers (an averager's
export, ``shardavg export``, ``shardavg posthoc``, ``merge``) and read back by one parser; the
metadata of folders already on disk (every shape shardavg wrote) reads as before, byte for byte."""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import shardavg
from shardavg.offline.saved_average import SavedAverage
from shardavg.output.model_folder import folder_export_id, read_record, weights_record
from shardavg.output.record import FolderRecord, MergedInput
from shardavg.posthoc import export_synthesized
from shardavg.rules import EMA

RULE = {"kind": "ema", "decay": 0.5}


def metadata(folder: Path) -> dict[str, str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        return file.metadata()


def written(folder: Path) -> FolderRecord:
    """The folder's record, checked to say again, byte for byte, what its files hold."""
    record = read_record(folder)
    assert record is not None and record.export_id == folder_export_id(folder)
    assert record.to_metadata()["shardavg"] == metadata(folder)["shardavg"]
    assert record.provenance == json.loads((folder / "provenance.json").read_text())
    return record


def averaged(steps: int = 3) -> shardavg.WeightAverager:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    averager = shardavg.WeightAverager(model, EMA(decay=0.5))
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(0.1)
        averager.update(step)
    return averager


def test_the_record_round_trips_for_all_four_writers(tmp_path) -> None:
    averager = averaged()
    exported = written(averager.export(tmp_path / "export"))
    assert (exported.made, exported.step, exported.num_updates, exported.world_size) == ("export", 3, 3, 1)
    assert (exported.average, exported.live, exported.strategy) == (None, False, "replicated")
    assert exported.rule is not None and exported.rule["kind"] == "ema" and exported.provenance["writers"] == 1
    assert exported.options == averager.options.to_json() and exported.options["dtype"] == "float32"
    live = written(averager.export(tmp_path / "live", live=True))
    assert (live.made, live.live, live.rule, live.provenance["average"]) == ("export", True, None, "live weights")

    checkpoint = averager.save(tmp_path / "ckpt")
    with closing(SavedAverage(checkpoint)) as saved:
        offline = written(saved.export(tmp_path / "cli", dtype=torch.bfloat16))
    assert (offline.made, offline.step, offline.num_updates, offline.rule) == ("export", 3, 3, exported.rule)
    assert offline.provenance["dtype"] == "bfloat16" and offline.provenance["inputs"][0]["path"] == str(checkpoint)

    posthoc = shardavg.PostHocEMA(nn.Linear(3, 2), snapshot_every=1, directory=tmp_path / "snapshots")
    for _ in range(3):
        posthoc.update()
    path, count = export_synthesized(tmp_path / "snapshots", tmp_path / "posthoc", 0.1, step=2)
    synthesized = written(path)
    assert (synthesized.made, synthesized.sigma_rel, synthesized.until, synthesized.step, count) == (
        "posthoc", 0.1, 2, None, 2,
    )  # fmt: skip
    assert synthesized.provenance["made"] == "posthoc"

    merged = written(shardavg.merge([tmp_path / "export", tmp_path / "cli"], tmp_path / "merge", weights=[3, 1]))
    assert (merged.made, merged.step, merged.carried) == ("merge", 3, ())
    assert merged.inputs == (
        MergedInput(str(tmp_path / "export"), 3, 0.75),
        MergedInput(str(tmp_path / "cli"), 3, 0.25),
    )
    assert [entry["weight"] for entry in merged.provenance["inputs"]] == [0.75, 0.25]


ON_DISK = {  # the "shardavg" metadata as earlier releases wrote it: (JSON, what it reads as)
    "export": (
        '{"average": null, "rule": {"kind": "ema", "decay": 0.5}, "step": 3, "num_updates": 3, '
        '"strategy": "fsdp2", "world_size": 4}',
        FolderRecord("export", 3, rule=RULE, num_updates=3, strategy="fsdp2", world_size=4),
    ),
    "live": (
        '{"weights": "live", "step": 7, "num_updates": 2, "strategy": "zero3", "world_size": 2}',
        FolderRecord("export", 7, live=True, num_updates=2, strategy="zero3", world_size=2),
    ),
    "posthoc": ('{"posthoc": {"sigma_rel": 0.05, "step": null}}', FolderRecord("posthoc", sigma_rel=0.05)),
    "merge": (
        '{"merge": [{"input": "a", "step": 1, "weight": 0.5}, {"input": "b", "step": null, "weight": 0.5}], '
        '"step": 1, "carried": ["config.json"]}',
        FolderRecord(
            "merge", 1, inputs=(MergedInput("a", 1, 0.5), MergedInput("b", None, 0.5)), carried=("config.json",)
        ),
    ),
}


@pytest.mark.parametrize("kind", sorted(ON_DISK))
def test_metadata_on_disk_reads_as_before_and_is_written_again_byte_for_byte(kind) -> None:
    text, expected = ON_DISK[kind]
    record = FolderRecord.from_metadata({"format": "pt", "shardavg": text, "export_id": "0123456789ab"})
    assert record == FolderRecord(**{**expected.__dict__, "export_id": "0123456789ab"})
    assert record.to_metadata() == {"format": "pt", "shardavg": text}


def test_older_or_damaged_records_read_as_unknown_and_foreign_weights_as_none() -> None:
    older_merge = FolderRecord.from_metadata({"shardavg": '{"merge": [], "step": 4}'})  # before "carried" (0.4)
    assert older_merge == FolderRecord("merge", 4)
    for damaged in ("not json", "[1, 2]", '{"step": "three", "world_size": true}'):
        assert FolderRecord.from_metadata({"shardavg": damaged}) == FolderRecord("export")  # shardavg's, unknown
    assert FolderRecord.from_metadata({"format": "pt"}) is None  # not shardavg's
    assert FolderRecord.from_metadata(None) is None and FolderRecord.from_metadata(["shardavg"]) is None


def test_an_index_carries_the_same_record_as_its_files(tmp_path) -> None:
    folder = averaged().export(tmp_path / "split", max_shard_size=8)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    record = weights_record(folder)
    assert record is not None and record.to_metadata()["shardavg"] == index["metadata"]["shardavg"]
    assert read_record(folder).export_id == index["metadata"]["export_id"]
