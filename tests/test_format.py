"""The typed description (``format.Description``): what an averager describes is what a reader
parses back, field by field; a manifest gives each tensor its layout; a count is an int and
never a bool; the offline outputs record where they came from."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import trained

from shardavg import EMA, CheckpointError, PostHocEMA
from shardavg.checkpoints.description import TensorEntry, with_checksum
from shardavg.checkpoints.format import MANIFEST, check_description, parse_manifest
from shardavg.cli import main as cli_main
from shardavg.layouts.tensor_layout import MeshLayout
from shardavg.output.provenance import read as read_provenance


def test_a_description_parses_back_to_itself(trainer) -> None:
    averager = trained(trainer, steps=3, rule={"fast": EMA(decay=0.9), "slow": EMA(decay=0.99)})
    described = averager._state.describe()
    parsed = check_description(json.loads(json.dumps(described.to_json())), "test")
    assert replace(parsed, checksum=None) == described
    edited = {**described.to_json(), "step": described.step + 1}
    with pytest.raises(CheckpointError, match="^edited.json: the checksum does not match"):
        check_description(edited, "edited.json")
    assert parsed.average_names == ["fast", "slow"] and parsed.rule("slow") == EMA(decay=0.99).to_config()
    by_name = parsed.by_name()
    tied = next(entry for entry in parsed.tensors if entry.aliases)
    assert all(by_name[name] is tied for name in tied.names)
    assert all(isinstance(entry, TensorEntry) and isinstance(entry.shape, tuple) for entry in parsed.tensors)


def test_a_manifest_gives_every_entry_its_layout_and_files(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=2)
    path = averager.save(tmp_path / "ckpt")
    manifest = parse_manifest((path / MANIFEST).read_bytes(), str(path))
    assert manifest.files == ("rank-00000-of-00001.safetensors",) and len(manifest.digests) == 1
    assert manifest.digests[0].bytes == (path / manifest.files[0]).stat().st_size
    assert manifest.save_id is not None and manifest.sequence is not None and manifest.checksum.startswith("sha256:")
    for entry in manifest.tensors:
        assert isinstance(entry.layout, MeshLayout) and entry.layout.shape == entry.shape
        assert entry.nbytes == entry.numel * entry.torch_dtype.itemsize


@pytest.mark.parametrize("key", ["step", "num_updates", "world_size"])
def test_a_bool_is_no_count(trainer, key: str) -> None:
    raw = trained(trainer, steps=1)._state.describe().to_json()
    raw[key] = True  # (checksummed again: a crafted description, not a damaged one)
    with pytest.raises(CheckpointError, match=f"'{key}' must be an integer"):
        check_description(with_checksum(raw), "crafted")


def test_posthoc_output_records_the_snapshots_it_combines(trainer, tmp_path, capsys) -> None:
    posthoc = PostHocEMA(trainer.model, snapshot_every=2, directory=tmp_path / "snapshots")
    for _ in range(6):
        trainer.step()
        posthoc.update()
    out = tmp_path / "ema-0.08"
    assert cli_main(["posthoc", str(tmp_path / "snapshots"), str(out), "--sigma-rel", "0.08"]) == 0
    record = read_provenance(out)
    assert record["made"] == "posthoc" and record["sigma_rel"] == pytest.approx(0.08)
    assert {entry["profile"] for entry in record["inputs"]} == {"profile-0", "profile-1"}
    snapshots = str(tmp_path / "snapshots")
    assert all(entry["step"] > 0 and entry["path"].startswith(snapshots) for entry in record["inputs"])
    assert cli_main(["inspect", str(out)]) == 0
    assert "made posthoc" in capsys.readouterr().out  # (its weights are checked against the synthesis in test_posthoc)
