"""Every file of a checkpoint is hashed as it is written; ``load(verify=True)``, ``shardavg inspect
--verify`` and ``shardavg export --verify`` hash it again and refuse any byte that changed."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import as_flat_ranges, assert_same_average, fresh, trained
from safetensors import safe_open

from shardavg import CheckpointError
from shardavg.checkpoints.description import with_checksum
from shardavg.cli import main as cli_main

SHARD = "rank-00000-of-00001.safetensors"


def one_line(capsys) -> str:
    said = capsys.readouterr().err
    assert said.startswith("shardavg: error:") and len(said.strip().splitlines()) == 1, said
    return said


def test_the_manifest_records_each_files_size_hash_and_save(trainer, tmp_path) -> None:
    path = trained(trainer, steps=3).save(tmp_path / "ckpt")
    meta = json.loads((path / "shardavg.json").read_text())
    data = (path / SHARD).read_bytes()
    assert meta["files"] == 1 and meta["digests"] == [[len(data), hashlib.sha256(data).hexdigest()]]
    with safe_open(str(path / SHARD), "pt") as handle:  # the safetensors library reads what we wrote
        assert handle.metadata() == {"shardavg_save": meta["save_id"]}
    other = trained(trainer, steps=1).save(tmp_path / "other")
    assert json.loads((other / "shardavg.json").read_text())["save_id"] != meta["save_id"]


def test_a_changed_byte_is_refused_by_every_verifying_reader(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    path = averager.save(tmp_path / "ckpt")
    reference = fresh()
    reference.load(path, verify=True)
    assert_same_average(reference, averager)
    assert cli_main(["inspect", str(path), "--verify"]) == 0
    assert "verified     1 file(s)" in capsys.readouterr().out
    data = bytearray((path / SHARD).read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length : 8 + length + 4] = struct.pack("<f", float("nan"))  # a NaN in the first tensor
    (path / SHARD).write_bytes(bytes(data))
    untouched = fresh()
    with pytest.raises(CheckpointError, match=rf"{path / SHARD}: its content does not match the SHA-256"):
        untouched.load(path, verify=True)
    assert untouched.num_updates == 0
    assert cli_main(["inspect", str(path), "--verify"]) == 2
    assert "does not match the SHA-256" in one_line(capsys)
    assert cli_main(["export", str(path), str(tmp_path / "out"), "--verify"]) == 2
    assert "does not match the SHA-256" in one_line(capsys) and not (tmp_path / "out").exists()


def test_older_checkpoints_load_but_cannot_be_verified(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    path = averager.save(tmp_path / "v3")
    meta = json.loads((path / "shardavg.json").read_text())
    for key in ("digests", "save_id", "checksum"):
        meta.pop(key)
    (path / "shardavg.json").write_text(json.dumps(with_checksum(as_flat_ranges(meta, 3))))
    restored = fresh()
    restored.load(path)
    assert_same_average(restored, averager)
    with pytest.raises(CheckpointError, match=r"older shardavg \(format version 3\), which recorded no checksums"):
        fresh().load(path, verify=True)
    assert cli_main(["inspect", str(path), "--verify"]) == 2 and "recorded no checksums" in one_line(capsys)
    meta = json.loads((path / "shardavg.json").read_text())
    (path / "shardavg.json").write_text(json.dumps(with_checksum({k: v for k, v in meta.items() if k != "checksum"}
                                                                 | {"version": 4})))  # fmt: skip
    with pytest.raises(CheckpointError, match="'save_id' must be 32 hex digits"):
        fresh().load(path)


def test_a_dcp_checkpoint_has_nothing_to_verify(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    dcp.save({"ema": averager}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert cli_main(["inspect", str(tmp_path / "dcp")]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "dcp"), "--verify"]) == 2
    assert "DCP checkpoint, which records no checksums" in one_line(capsys)


def test_loading_reads_without_mapping_and_into_the_shadows(trainer, tmp_path, monkeypatch) -> None:
    """The reader never maps a file (memory holds what was read, and nothing else), and a bf16
    checkpoint loads into fp32 shadows through bounded pieces."""
    import mmap

    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: pytest.fail("a checkpoint file was mapped"))
    averager = trained(trainer, steps=3)
    path = averager.save(tmp_path / "bf16", dtype=torch.bfloat16)
    monkeypatch.setattr("shardavg.checkpoints.storage.READ_PIECE", 8)  # two elements at a time
    restored = fresh()
    restored.load(path, verify=True)
    got, want = restored.full_state_dict(), averager.full_state_dict()
    meta = json.loads((path / "shardavg.json").read_text())
    cast = {name for t in meta["tensors"] if t["role"] == "average" for name in (t["name"], *t["aliases"])}
    assert cast and any(t["dtype"] == "bfloat16" for t in meta["tensors"])
    for name, value in want.items():
        expected = value.to(torch.bfloat16).to(value.dtype) if name in cast else value
        assert torch.equal(got[name], expected), name
