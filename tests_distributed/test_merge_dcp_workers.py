"""``torchrun -m shardavg merge --format dcp`` at 2 workers: each worker writes its own part of the DCP
checkpoint (the largest tensor in row pieces across both), the first commits ``.metadata``; the result
loads back with DCP's own ``dcp_to_torch_save`` equal to the one-process merge, and a Megatron merge
carries its files and ``*._extra_state`` byte for byte, and the averager saved beside its model
unchanged (the first worker writes it), in the ``iter_NNNNNNN`` folder its tracker names; a re-merge
that fails late on the workers leaves the earlier merge byte for byte and no staging folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launcher import torchrun
from test_dcp_checkpoint import raw_item
from test_merge_dcp_output import torchtitan_save, weights
from test_merge_megatron import megatron_save, model, with_averager
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardavg
from shardavg.offline.saved_average import DcpFolder

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out


def whole(folder: Path, into: Path, kind: str) -> dict:
    """``folder`` as DCP's own converter reads it; Megatron's, as ``dcp.load`` reads its tensors (its
    ``*._extra_state`` entries are pickles, which ``torch.load(weights_only=True)`` refuses)."""
    if kind == "megatron":
        state = {name: torch.empty_like(tensor) for name, tensor in model(0).items()}
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        return state
    dcp_to_torch_save(str(folder), str(into))
    return torch.load(into, weights_only=True)


def files_of_chunks(folder: Path) -> dict[str, set[str]]:
    """``{key: the part files holding its chunks}`` as the committed metadata records them."""
    metadata = DcpFolder(folder).metadata
    found: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        found.setdefault(index.fqn, set()).add(info.relative_path)
    return found


@pytest.mark.parametrize("kind", ["torchtitan", "megatron"])
def test_two_workers_write_a_dcp_checkpoint_equal_to_one_process(tmp_path: Path, kind: str) -> None:
    inputs = [tmp_path / "inputs" / name for name in ("iter_0000100", "iter_0000200")]
    for seed, folder in enumerate(inputs):
        if kind == "megatron":  # (an averager beside the model, as avg.sharded_state_dict(prefix="ema.") saves it)
            megatron_save(folder, with_averager(seed, "ema.", 100 + 100 * seed), tmp_path / "unpickled", tp=1 + seed)
        else:
            torchtitan_save(folder, seed)
    one = shardavg.merge(inputs, tmp_path / "one", weights=[1, 3], output="dcp")
    out = tmp_path / "two"
    args = [*map(str, inputs), "--out", str(out), "--format", "dcp", "--weights", "1", "3"]
    launch = torchrun("scenario_merge.py", 2, "cli", str(tmp_path), *args, timeout=180)
    assert launch.returncode == 0, launch.output[-20000:]
    assert [r["code"] for r in launch.reports("EXIT")] == [0, 0], launch.output[-5000:]
    assert launch.output.count("wrote the merge of 2 checkpoints") == 1, "not only the first worker reports"
    if kind == "megatron":  # (a Megatron-LM run folder: the iteration of the newest input, and its tracker)
        assert one == tmp_path / "one" / "iter_0000200"
        assert (out / "latest_checkpointed_iteration.txt").read_text() == "200"
        out = out / "iter_0000200"
    want, got = whole(one, tmp_path / "one.pt", kind), whole(out, tmp_path / "two.pt", kind)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert type(got[key]) is type(value), key
        if isinstance(value, dict):
            assert all(torch.equal(got[key][n], t) and got[key][n].dtype == t.dtype for n, t in value.items()), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value) and got[key].dtype == value.dtype, key
    chunks = files_of_chunks(out)
    parts = {file for files in chunks.values() for file in files}
    assert sorted(file.split("_")[2] for file in parts) == ["0", "1"] and len({f.split("_")[3] for f in parts}) == 1
    if kind == "torchtitan":  # (the embedding, over half the bytes, in row pieces from both workers)
        assert chunks["model.embed.weight"] == parts, chunks
    else:
        for name in ("metadata.json", "common.pt"):
            assert (out / name).read_bytes() == (inputs[-1] / name).read_bytes(), name
        extra = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_3"
        assert raw_item(out, extra) == raw_item(inputs[-1], extra)
        averager = {key: value for key, value in with_averager(1, "ema.", 200).items() if key.startswith("ema.")}
        for key, value in averager.items():  # the newest input's, unchanged, all in the first worker's part
            assert torch.equal(DcpFolder(out).read(key), value) and DcpFolder(out).read(key).dtype == value.dtype, key
            assert [file.split("_")[2] for file in chunks[key]] == ["0"], chunks[key]
        assert not (tmp_path / "unpickled").exists()
    made = json.loads((out / "provenance.json").read_text())
    assert made["world_size"] == 2 and made["output"] == "dcp", made


def test_two_workers_that_fail_late_leave_the_earlier_merge_whole(tmp_path: Path) -> None:
    """A re-merge at 2 workers over an earlier merge that fails while the workers write (a value
    an fp16 output cannot hold, found only when its rows are merged): every worker fails, the
    staging folder goes, and OUT is the earlier merge byte for byte."""
    inputs = [tmp_path / "inputs" / name for name in ("step-1", "step-2")]
    torchtitan_save(inputs[0], 1)
    huge = weights(2)
    huge["embed.weight"][:, 0] = 1e6  # (in every row: whichever worker merges which rows fails)
    dcp.save({"model": huge}, checkpoint_id=str(inputs[1]), no_dist=True)
    out = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    before = {path.name: path.read_bytes() for path in sorted(out.iterdir())}
    args = [*map(str, inputs), "--out", str(out), "--format", "dcp", "--dtype", "float16"]
    launch = torchrun("scenario_merge.py", 2, "cli", str(tmp_path), *args, timeout=180)
    assert launch.returncode != 0 and "overflow float16" in launch.output, launch.output[-5000:]
    assert [r["code"] for r in launch.reports("EXIT")] == [2, 2], launch.output[-5000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "out"]  # no staging folder, no lock
    assert {path.name: path.read_bytes() for path in sorted(out.iterdir())} == before
