"""``shardavg merge --format dcp``: the merge as a ``torch.distributed.checkpoint`` folder under the inputs'
keys, loaded back with DCP's own loaders (``dcp.load`` without a process group, ``dcp_to_torch_save``) and
equal to numpy's weighted average; a Megatron-Core merge carrying its files and ``*._extra_state`` byte for
byte; OUT refused where it is not the merge's own; a merge that fails leaves OUT as it was (the earlier merge
whole, or nothing) and no staging folder."""

from __future__ import annotations

import io
import json
import re
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
    """A model's tensors: fp32 matrices (one of 12 rows, split in pieces between writers), a bf16 vector, a counter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(12, 4, generator=g),
        "blocks.0.up.weight": torch.randn(6, 4, generator=g),
        "blocks.0.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "blocks.0.norm.num_batches_tracked": torch.tensor(seed * 10),
    }


def torchtitan_save(folder: Path, seed: int, training: bool = False) -> None:
    """``folder`` as torchtitan before 2025 saves it: ``{"model": ..., "optimizer": ...}`` through ``dcp.save``;
    ``training``: with the training state a step it resumes from holds (``train_state``, ``dataloader``)."""
    model = weights(seed)
    optimizer = {"state": {name: t.float() * 2 for name, t in model.items() if t.is_floating_point()}}
    state = {"model": model, "optimizer": optimizer}
    if training:
        state |= {"train_state": {"step": torch.tensor(seed)}, "dataloader": {"dp_rank_0": io.BytesIO(b"position")}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


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
    assert names(out) == [".metadata", "__0_*.distcp", "provenance.json"]
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
    for carried in ("decoder.layers.self_attention.linear_proj._extra_state/shard_0_3", "common_state"):
        assert raw_item(out, carried) == raw_item(inputs[-1], carried), carried  # (0.19 loads its common state here)
    mean = numpy_mean([megatron_model(0), megatron_model(1)], [0.5, 0.5])
    dtypes = {name: tensor.dtype for name, tensor in megatron_model(0).items()}
    want = {name: torch.from_numpy(value).to(dtypes[name]) for name, value in mean.items()}
    assert_equal(loaded(out, want, None), want)  # Megatron's flat keys, its [L, ...] stacks whole
    again = open_source(out)  # a torch_dist checkpoint again
    assert again.left_out == {"*._extra_state": 1, "common.pt": 1, "common_state": 1}
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


def interrupted_after_the_first_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every writer's part fail after its first piece is written (a full disk, a bad input found late)."""
    written = dcp_checkpoint.write_part

    def interrupted(folder, rank, chunks, objects=(), merge="0"):
        def some():
            for count, chunk in enumerate(chunks):
                if count == 1:
                    raise OSError("No space left on device")
                yield chunk

        return written(folder, rank, some(), objects, merge)

    monkeypatch.setattr(dcp_checkpoint, "write_part", interrupted)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("where", ["writing", "committing", "swapping"])
def test_a_remerge_that_fails_leaves_the_earlier_merge_whole_and_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    for seed in (1, 2):
        torchtitan_save(tmp_path / f"step-{seed}", seed)
    inputs = [tmp_path / "step-1", tmp_path / "step-2"]
    out = shardavg.merge(inputs, tmp_path / "out", output="dcp")
    before = snapshot(out)
    if where == "writing":
        interrupted_after_the_first_piece(monkeypatch)
        error, message = OSError, "No space left on device"
    elif where == "committing":
        monkeypatch.setattr(dcp_checkpoint, "commit", lambda *args: (_ for _ in ()).throw(OSError("disk gone")))
        error, message = OSError, "disk gone"
    else:  # someone wrote into OUT during the merge: it is no longer the merge's to replace
        committed = dcp_checkpoint.commit

        def commit_then_someone_writes(*args):
            committed(*args)
            (out / "notes.txt").write_text("mine")

        monkeypatch.setattr(dcp_checkpoint, "commit", commit_then_someone_writes)
        error, message = shardavg.CheckpointError, r"holds files a merge did not write \(notes.txt\)"
    with pytest.raises(error, match=message):
        shardavg.merge(inputs, out, weights=[1, 3], output="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "step-1", "step-2"]  # no staging, no lock
    if where == "swapping":
        (out / "notes.txt").unlink()
    assert snapshot(out) == before  # the earlier merge, byte for byte
    want = expected([1, 2], [0.5, 0.5])
    assert_equal(loaded(out, want, "model"), want)
    monkeypatch.undo()
    shardavg.merge(inputs, out, weights=[1, 3], output="dcp")  # a merge that succeeds replaces it
    want = expected([1, 2], [0.25, 0.75])
    assert_equal(loaded(out, want, "model"), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "step-1", "step-2"]
    assert names(out) == [".metadata", "__0_*.distcp", "provenance.json"]
    assert dcp.FileSystemReader(str(out)).read_metadata().storage_meta.checkpoint_id == out  # (not its staging name)


def test_a_first_merge_that_fails_leaves_no_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in (1, 2):
        torchtitan_save(tmp_path / f"step-{seed}", seed)
    inputs = [tmp_path / "step-1", tmp_path / "step-2"]
    interrupted_after_the_first_piece(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        shardavg.merge(inputs, tmp_path / "out", output="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]  # not even an empty folder
    monkeypatch.setattr(merge_module.megatron, "is_torch_dist", lambda path: 1 / 0)  # the lead's preparation fails
    with pytest.raises(ZeroDivisionError):
        shardavg.merge(inputs, tmp_path / "out", output="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_what_a_killed_merge_left_is_removed_and_anything_else_refused(tmp_path: Path) -> None:
    for seed in (1, 2):
        torchtitan_save(tmp_path / f"step-{seed}", seed)
    inputs = [tmp_path / "step-1", tmp_path / "step-2"]
    out, staging = tmp_path / "out", tmp_path / ".out.incomplete"
    staging.mkdir()
    (staging / ".shardavg-staging").write_text("a killed merge's token")
    (staging / "__0_0.distcp").write_bytes(b"half a part")
    (staging / ".__1_0.distcp.incomplete").write_bytes(b"half a part")
    shardavg.merge(inputs, out, output="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "step-1", "step-2"]
    want = expected([1, 2], [0.5, 0.5])
    assert_equal(loaded(out, want, "model"), want)
    staging.mkdir()
    (staging / "notes.txt").write_text("mine")
    with pytest.raises(
        shardavg.CheckpointError, match=r"\.out\.incomplete is in the way of the merge into .*: move it"
    ):
        shardavg.merge(inputs, out, weights=[1, 3], output="dcp")
    assert (staging / "notes.txt").read_text() == "mine"
    assert_equal(loaded(out, want, "model"), want)


def names(folder: Path) -> list[str]:
    """The folder's files, a part's merge token shown as ``*``."""
    return sorted(re.sub(r"^(__\d+_)[0-9a-f]{32}(\.distcp)$", r"\1*\2", p.name) for p in folder.iterdir())


def test_a_reader_holding_an_earlier_merges_metadata_finds_its_files_gone_not_the_new_bytes(tmp_path: Path) -> None:
    """Each merge names its parts by its own token: a reader that read the earlier ``.metadata``
    and opens its parts after a re-merge swapped the folder gets "no such file", never the new
    merge's bytes at the earlier offsets (DCP's reader checks no identity of its own)."""
    inputs = [tmp_path / f"step-{seed}" for seed in (1, 2)]
    for seed, folder in zip((1, 2), inputs):
        torchtitan_save(folder, seed)
    out = shardavg.merge(inputs, tmp_path / "out", weights=[1, 1], output="dcp")
    earlier = dcp.FileSystemReader(str(out)).read_metadata()
    shardavg.merge(inputs, out, weights=[1, 3], output="dcp")
    parts = {info.relative_path for info in earlier.storage_data.values()}
    assert parts and not any((out / part).exists() for part in parts)
    state = {"model": {name: torch.empty_like(t) for name, t in expected([1, 2], [0.5, 0.5]).items()}}
    with pytest.raises(dcp.api.CheckpointException) as failed:
        dcp.load(state, storage_reader=KeptMetadata(str(out), earlier), no_dist=True)
    assert [type(error) for error, _ in failed.value.failures.values()] == [FileNotFoundError]


class KeptMetadata(dcp.FileSystemReader):
    """A reader that keeps the ``.metadata`` it read first, as a load that began before a re-merge does."""

    def __init__(self, path: str, metadata: object) -> None:
        super().__init__(path)
        self.kept = metadata

    def read_metadata(self, *args: object, **kwargs: object) -> object:
        return self.kept


def test_the_current_directory_as_out_is_refused_before_anything_is_read(tmp_path: Path, monkeypatch) -> None:
    """A dcp merge replaces OUT whole (a staged folder swapped into place): ``.`` cannot be."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ValueError, match="names the current or a parent folder"):
        shardavg.merge([tmp_path / "missing-1", tmp_path / "missing-2"], ".", output="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and not any((tmp_path / "work").iterdir())


def test_out_as_a_step_of_a_torchtitan_run_is_refused_saying_how_to_load_a_merge(tmp_path: Path) -> None:
    """A merge written as ``checkpoint/step-N`` of a torchtitan run became the step its next restart resumed
    from, which then failed on the training state ("Missing key ... dataloader.dp_rank_0")."""
    checkpoint = tmp_path / "run" / "checkpoint"
    inputs = [checkpoint / f"step-{step}" for step in (10, 20)]
    for seed, folder in enumerate(inputs):
        torchtitan_save(folder, seed, training=True)
    for name in ("step-30", "merged-step-30"):  # (torchtitan finds step-N anywhere in a folder's name)
        with pytest.raises(shardavg.CheckpointError) as refused:
            shardavg.merge(inputs, checkpoint / name, output="dcp")
        message = str(refused.value)
        assert f"OUT {checkpoint / name} would be a step of the torchtitan run checkpointed in {checkpoint}" in message
        assert "checkpoint.initial_load_path=OUT and checkpoint.initial_load_model_only=true" in message
        assert "\n" not in message and not (checkpoint / name).exists()
    models = tmp_path / "models"  # steps without training state (a model-only save): no run resumes from them
    for seed in (1, 2):
        torchtitan_save(models / f"step-{seed}", seed)
    out = shardavg.merge([models / "step-1", models / "step-2"], models / "step-3", output="dcp")
    assert_equal(loaded(out, expected([1, 2], [0.5, 0.5]), "model"), expected([1, 2], [0.5, 0.5]))
