"""``output.dcp_checkpoint``: a merge written as a DCP checkpoint by several writers, each its own file,
loaded back by DCP's own loaders (``dcp.load``, ``dcp_to_torch_save``) and by shardavg's reader; Megatron's
files carried byte for byte; a Megatron-Core merge read back as the checkpoint it merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_merge_megatron import megatron_save, model, numpy_mean
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardavg
from shardavg.offline import megatron
from shardavg.offline.saved_average import DcpFolder
from shardavg.offline.sources import open_source
from shardavg.output.dcp_checkpoint import carry, commit, nesting_of, part_name, write_part

TENSORS = {
    "model.layers.w": torch.arange(72, dtype=torch.float32).reshape(3, 6, 4),
    "model.norm": torch.linspace(-1, 1, 32).to(torch.bfloat16).reshape(4, 8),
    "model.scale": torch.tensor(0.5),
}


def two_workers(folder: Path, nesting: dict | None = None) -> None:
    """Writer 0 writes rows [0, 2) of the stack and the bf16 tensor; writer 1 the last row and the scalar."""
    folder.mkdir()
    first = write_part(folder, 0, [("model.layers.w", (0, 2), TENSORS["model.layers.w"][:2]),
                                   ("model.norm", None, TENSORS["model.norm"])])  # fmt: skip
    second = write_part(folder, 1, [("model.layers.w", (2, 3), TENSORS["model.layers.w"][2:]),
                                    ("model.scale", None, TENSORS["model.scale"])])  # fmt: skip
    commit(folder, {k: (v.dtype, tuple(v.shape)) for k, v in TENSORS.items()}, first + second, nesting)


def raw_item(folder: Path, key: str) -> bytes:
    """An object's bytes as DCP stored them in ``folder`` (checked to lie in it; never unpickled)."""
    file, start, length = DcpFolder(folder).location(key, None, 2**20)
    with open(file, "rb") as handle:
        handle.seek(start)
        return handle.read(length)


def test_every_workers_chunks_load_back_with_dcps_own_loaders(tmp_path: Path) -> None:
    nested = {key: ("model", key.removeprefix("model.")) for key in TENSORS}  # (as {"model": model_sd} saves)
    two_workers(tmp_path / "out", nested)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata", part_name(0), part_name(1)]
    loaded = {"model": {k.removeprefix("model."): torch.empty_like(v) for k, v in TENSORS.items()}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    for key, value in TENSORS.items():
        assert torch.equal(loaded["model"][key.removeprefix("model.")], value), key
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    assert all(torch.equal(whole[k.removeprefix("model.")], v) for k, v in TENSORS.items())
    folder = DcpFolder(tmp_path / "out")  # (shardavg's own restricted reader)
    assert all(torch.equal(folder.read(k), v) and folder.read(k).dtype == v.dtype for k, v in TENSORS.items())
    assert nesting_of(folder.metadata) == nested


def test_a_missing_chunk_is_refused_before_the_metadata_is_written(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    written = write_part(tmp_path / "out", 0, [("model.layers.w", (0, 2), TENSORS["model.layers.w"][:2])])
    with pytest.raises(shardavg.CheckpointError, match=r"the writers wrote 48 of 'model.layers.w''s 72 elements"):
        commit(tmp_path / "out", {"model.layers.w": (torch.float32, (3, 6, 4))}, written)
    assert not (tmp_path / "out" / ".metadata").exists()


def test_a_megatron_merge_is_a_torch_dist_checkpoint_again(tmp_path: Path) -> None:
    """Megatron inputs merged into a DCP output (as --format dcp would: the merged tensors under the
    inputs' keys, Megatron's files carried from the newest input), read back as Megatron's."""
    inputs = []
    for seed, tp in ((0, 1), (1, 2)):
        inputs.append(tmp_path / f"iter_000000{seed}")
        megatron_save(inputs[-1], model(seed), tmp_path / "unpickled", tp=tp)
    sources = [open_source(path) for path in inputs]
    want = numpy_mean([model(0), model(1)], [0.5, 0.5])
    out = tmp_path / "merged"
    out.mkdir()
    merged = {name: torch.from_numpy(value).to(sources[-1].specs[name].dtype) for name, value in want.items()}
    objects, files = megatron.carried(sources[-1].folder)  # (the newest input's)
    extra = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_3"  # (Megatron's load asks for it)
    assert sorted(key for key, _ in objects) == ["common_state", extra]  # (0.19 loads its common state there)
    assert [f.name for f in files] == ["metadata.json", "common.pt"]
    written = write_part(out, 0, [(name, None, tensor) for name, tensor in merged.items()], objects)
    commit(out, {name: (t.dtype, tuple(t.shape)) for name, t in merged.items()}, written)
    carry(out, files)
    assert (out / "common.pt").read_bytes() == (inputs[-1] / "common.pt").read_bytes()
    assert all(raw_item(out, key) == raw_item(inputs[-1], key) for key in ("common_state", extra))
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    again = open_source(out)
    assert again.left_out == {"*._extra_state": 1, "common.pt": 1, "common_state": 1}
    assert sorted(again.specs) == sorted(merged)
    assert all(torch.equal(again.read(name), tensor) for name, tensor in merged.items())
    assert not (tmp_path / "unpickled").exists()
    with pytest.raises(shardavg.CheckpointError, match="is the checkpoint's own DCP data"):
        carry(out, [inputs[-1] / ".metadata"])
