"""``shardavg merge --format dcp``: the merge as a ``torch.distributed.checkpoint`` folder under the inputs'
keys, loaded back with DCP's own loaders (``dcp.load`` without a process group, ``dcp_to_torch_save``) and
equal to numpy's weighted average; a Megatron-Core merge carrying its files and ``*._extra_state`` byte for
byte; OUT refused where it is not the merge's own; a merge that fails leaves no ``.metadata``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from test_dcp_checkpoint import raw_item
from test_merge_megatron import megatron_save, numpy_mean
from test_merge_megatron import model as megatron_model
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardavg
from shardavg.cli import main
from shardavg.offline import merge as merge_module
from shardavg.offline.sources import open_source
from shardavg.output import dcp_checkpoint


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A model's tensors: fp32 matrices (one of 12 rows, split in pieces between workers), a bf16 vector, a counter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(12, 4, generator=g),
        "blocks.0.up.weight": torch.randn(6, 4, generator=g),
        "blocks.0.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "blocks.0.norm.num_batches_tracked": torch.tensor(seed * 10),
    }


def torchtitan_save(folder: Path, seed: int) -> None:
    """``folder`` as torchtitan before 2025 saves it: ``{"model": ..., "optimizer": ...}`` through ``dcp.save``."""
    model = weights(seed)
    optimizer = {"state": {name: t.float() * 2 for name, t in model.items() if t.is_floating_point()}}
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=str(folder), no_dist=True)


def hf_save(folder: Path, seed: int) -> None:
    folder.mkdir(parents=True)
    save_file(weights(seed), str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "tiny"}')


def expected(seeds: list[int], shares: list[float]) -> dict[str, torch.Tensor]:
    """numpy's sum(w_i * x_i) in fp32, cast to each tensor's dtype; the counter from the last input."""
    states = [weights(seed) for seed in seeds]
    floating = [{n: t for n, t in state.items() if t.is_floating_point()} for state in states]
    mean = numpy_mean(floating, shares)
    want = {name: torch.from_numpy(value).to(states[0][name].dtype) for name, value in mean.items()}
    counter = "blocks.0.norm.num_batches_tracked"
    return want | {counter: states[-1][counter]}


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def loaded(folder: Path, want: dict[str, torch.Tensor], entry: str | None) -> dict[str, torch.Tensor]:
    """``folder`` read back by ``dcp.load`` (no process group) into tensors shaped like ``want``."""
    empty = {name: torch.empty_like(t) for name, t in want.items()}
    state = {entry: empty} if entry else empty
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return empty


def test_dcp_inputs_merge_into_a_checkpoint_their_trainer_loads(tmp_path: Path) -> None:
    inputs = [tmp_path / f"step-{seed}" for seed in (1, 2, 3)]
    for seed, folder in zip((1, 2, 3), inputs):
        torchtitan_save(folder, seed)
    out = shardavg.merge(inputs, tmp_path / "out", weights=[1, 2, 5], output="dcp")
    want = expected([1, 2, 3], [1 / 8, 2 / 8, 5 / 8])
    assert_equal(loaded(out, want, "model"), want)  # nested under "model", as the inputs were
    dcp_to_torch_save(str(out), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert sorted(whole) == ["model"]  # the optimizer is not a merge's
    assert_equal(whole["model"], want)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "provenance.json"]
    made = json.loads((out / "provenance.json").read_text())
    assert made["made"] == "merge" and made["output"] == "dcp" and made["world_size"] == 1
    assert [i["left_out"] for i in made["inputs"]] == [{"optimizer": 3}] * 3


def test_hf_folders_merge_into_dcp_from_the_command_line(tmp_path: Path) -> None:
    for seed in (4, 5):
        hf_save(tmp_path / f"checkpoint-{seed}", seed)
    args = [str(tmp_path / "checkpoint-4"), str(tmp_path / "checkpoint-5"), "--out", str(tmp_path / "out")]
    assert main(["merge", *args, "--format", "dcp", "--weights", "1", "3", "--quiet"]) == 0
    want = expected([4, 5], [0.25, 0.75])
    assert_equal(loaded(tmp_path / "out", want, None), want)  # the names at the top level
    again = open_source(tmp_path / "out")  # (and shardavg reads its own output back)
    assert_equal({name: again.read(name) for name in again.specs}, want)
    again.close()


def test_a_megatron_merge_carries_its_files_and_extra_state_byte_for_byte(tmp_path: Path) -> None:
    inputs = [tmp_path / "iter_0000100", tmp_path / "iter_0000200"]
    for seed, (folder, tp) in enumerate(zip(inputs, (1, 2))):
        megatron_save(folder, megatron_model(seed), tmp_path / "unpickled", tp=tp)
    out = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    for name in ("metadata.json", "common.pt"):
        assert (out / name).read_bytes() == (inputs[-1] / name).read_bytes(), name
    extra = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_3"
    assert raw_item(out, extra) == raw_item(inputs[-1], extra)
    mean = numpy_mean([megatron_model(0), megatron_model(1)], [0.5, 0.5])
    dtypes = {name: tensor.dtype for name, tensor in megatron_model(0).items()}
    want = {name: torch.from_numpy(value).to(dtypes[name]) for name, value in mean.items()}
    assert_equal(loaded(out, want, None), want)  # Megatron's flat keys, its [L, ...] stacks whole
    again = open_source(out)  # a torch_dist checkpoint again
    assert again.left_out == {"*._extra_state": 1, "common.pt": 1}
    again.close()
    assert not (tmp_path / "unpickled").exists()  # nothing carried was unpickled
    left_out = json.loads((out / "provenance.json").read_text())["inputs"][1]["left_out"]
    assert left_out == {"*._extra_state": 1, "common.pt": 1, "common_state": 1, "optimizer": 11, "rng_state": 2}


def test_large_tensors_are_split_in_row_pieces_between_workers() -> None:
    plan = [merge_module.Planned(("embed.weight",), ("embed.weight",)), merge_module.Planned(("b",), ("b",))]
    specs = [merge_module.Spec(torch.float32, (12, 4)), merge_module.Spec(torch.float32, (4,))]
    work = merge_module._work(plan, specs, "dcp", 2)
    assert [(w.index, w.rows, w.nbytes) for w in work] == [(0, (0, 6), 96), (0, (6, 12), 96), (1, None, 16)]
    assert merge_module.assign([w.nbytes for w in work], 2) == [0, 1, 1]


def test_out_is_refused_unless_it_is_new_empty_or_an_earlier_dcp_merge(tmp_path: Path) -> None:
    for seed in (1, 2):
        torchtitan_save(tmp_path / f"step-{seed}", seed)
    inputs = [tmp_path / "step-1", tmp_path / "step-2"]
    refusals = {
        inputs[0]: "lie one inside the other",
        inputs[0] / "sub": "is inside the checkpoint|lie one inside the other",
        tmp_path / "foreign": "holds a DCP checkpoint shardavg's merge did not write",
        tmp_path / "files": "holds files shardavg's merge did not write",
    }
    torchtitan_save(tmp_path / "foreign", 3)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "notes.txt").write_text("mine")
    before = {p: sorted(p.rglob("*")) for p in [*inputs, tmp_path / "foreign", tmp_path / "files"]}
    for out, message in refusals.items():
        with pytest.raises(shardavg.CheckpointError, match=message):
            shardavg.merge(inputs, out, output="dcp")
    assert {p: sorted(p.rglob("*")) for p in before} == before  # nothing written
    first = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    (first / "__3_0.distcp").write_bytes(b"an earlier merge's part, of a 4-worker merge")
    shardavg.merge(inputs, first, weights=[1, 3], output="dcp")  # an earlier merge: replaced
    assert not (first / "__3_0.distcp").exists()
    want = expected([1, 2], [0.25, 0.75])
    assert_equal(loaded(first, want, "model"), want)
    (first / "notes.txt").write_text("mine")
    with pytest.raises(shardavg.CheckpointError, match=r"holds files a merge did not write \(notes.txt\)"):
        shardavg.merge(inputs, first, output="dcp")
    (first / "notes.txt").unlink()
    with pytest.raises(shardavg.ExportError, match="is a checkpoint"):
        shardavg.merge(inputs, first)  # a model folder is never written over it
    hf_save(tmp_path / "hf-a", 1)
    hf_save(tmp_path / "hf-b", 2)
    model_folder = shardavg.merge([tmp_path / "hf-a", tmp_path / "hf-b"], tmp_path / "model-folder")
    with pytest.raises(shardavg.CheckpointError, match="holds files shardavg's merge did not write"):
        shardavg.merge(inputs, model_folder, output="dcp")


def test_a_merge_that_fails_leaves_no_metadata_and_a_folder_merge_can_take_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for seed in (1, 2):
        torchtitan_save(tmp_path / f"step-{seed}", seed)
    inputs = [tmp_path / "step-1", tmp_path / "step-2"]
    out = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    written = dcp_checkpoint.write_part

    def interrupted(folder, rank, chunks, objects=()):
        def some():
            for count, chunk in enumerate(chunks):
                if count == 2:
                    raise OSError("No space left on device")
                yield chunk

        return written(folder, rank, some(), objects)

    monkeypatch.setattr(dcp_checkpoint, "write_part", interrupted)
    with pytest.raises(OSError, match="No space left on device"):
        shardavg.merge(inputs, out, weights=[1, 3], output="dcp")
    assert not (out / ".metadata").exists()  # not a checkpoint: neither the earlier merge nor the new one
    assert not (out / "__0_0.distcp").exists() and json.loads((out / "provenance.json").read_text())["output"] == "dcp"
    monkeypatch.setattr(dcp_checkpoint, "write_part", written)
    monkeypatch.setattr(dcp_checkpoint, "commit", lambda *args: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        shardavg.merge(inputs, out, output="dcp")
    assert (out / "__0_0.distcp").exists() and not (out / ".metadata").exists()
    monkeypatch.undo()
    shardavg.merge(inputs, out, weights=[1, 3], output="dcp")  # the leftovers are the merge's: taken again
    want = expected([1, 2], [0.25, 0.75])
    assert_equal(loaded(out, want, "model"), want)
