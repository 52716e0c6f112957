"""Checkpoints, exports and the offline CLI in one process: round trips, atomicity and bad input."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import TiedNet
from helpers import assert_same_average, fresh, in_process_cli, replace_shard, trained
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import shardavg.averager.checkpoint
import shardavg.checkpoints.storage
from shardavg import EMA, SWA, CheckpointError, WeightAverager
from shardavg.output.model_writer import parse_size

MARKER_NAME = "pwned"


class Pwn:
    """A pickle that, when loaded, leaves a marker file: loading must never run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_and_resume(trainer, tmp_path) -> None:
    averager = trained(trainer)
    path = averager.save(tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == ["rank-00000-of-00001.safetensors", "shardavg.json"]
    restored = fresh()
    assert restored.load(path) == path
    assert (restored.step, restored.num_updates) == (5, 5)
    assert_same_average(restored, averager)

    restored_model = restored.strategy.model
    restored_model.load_state_dict(trainer.model.state_dict())
    for _ in range(3):  # both continue from the same live weights
        trainer.step()
        averager.update()
        restored_model.load_state_dict(trainer.model.state_dict())
        restored.update()
    assert_same_average(restored, averager)


def test_keep_last_keeps_the_newest_committed_checkpoints(trainer, tmp_path) -> None:
    averager = WeightAverager(trainer.model, EMA(decay=0.9))
    for _ in range(5):
        trainer.step()
        averager.update()
        averager.save(tmp_path, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000000004", "step-000000005"]
    restored = fresh()
    assert restored.load(tmp_path) == tmp_path / "step-000000005"
    assert restored.step == 5
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        averager.save(tmp_path, keep_last=0)


def test_a_failed_save_keeps_the_previous_checkpoint(trainer, tmp_path, monkeypatch) -> None:
    averager = trained(trainer, steps=2)
    averager.save(tmp_path / "ckpt")
    before = fresh()
    before.load(tmp_path / "ckpt")
    trainer.step()
    averager.update()

    real_write = shardavg.averager.checkpoint.write_safetensors

    def write_then_fail(path, entries, tensors, metadata=None):
        def first_then_fail():
            yield next(iter(tensors))
            raise OSError("disk full")

        real_write(path, entries, first_then_fail(), metadata)

    monkeypatch.setattr(shardavg.averager.checkpoint, "write_safetensors", write_then_fail)
    with pytest.raises(
        CheckpointError, match=r"writing shards to .*ckpt.incomplete failed: rank 0: OSError: disk full"
    ):
        averager.save(tmp_path / "ckpt")
    after = fresh()
    after.load(tmp_path / "ckpt")
    assert after.step == 2
    assert_same_average(after, before)
    with pytest.raises(CheckpointError, match=r"lack shardavg.json, so their save never completed"):
        fresh().load(tmp_path / ".ckpt.incomplete")


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_saving_over_a_checkpoint_replaces_it_whole(trainer, tmp_path, monkeypatch, exchange) -> None:
    if not exchange:  # a system or file system without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(shardavg.checkpoints.storage, "_exchange", lambda first, second: False)
    averager = trained(trainer, steps=2)
    averager.save(tmp_path / "ckpt")
    trainer.step()
    averager.update()
    averager.save(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging, lock or previous version left beside it
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["rank-00000-of-00001.safetensors", "shardavg.json"]
    restored = fresh()
    restored.load(tmp_path / "ckpt")
    assert restored.step == 3
    assert_same_average(restored, averager)


def test_a_save_interrupted_between_two_renames_is_reported_not_used(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    averager.save(tmp_path / "ckpt")
    os.replace(tmp_path / "ckpt", tmp_path / ".ckpt.replaced")  # as if killed between the two renames
    message = r"interrupted between its two renames .* rename it to ckpt to use it"
    with pytest.raises(CheckpointError, match=message):
        fresh().load(tmp_path / "ckpt")
    shown = cli("inspect", str(tmp_path / "ckpt"))
    assert shown.returncode == 2 and re.search(message, shown.stderr), shown.stderr
    os.replace(tmp_path / ".ckpt.replaced", tmp_path / "ckpt")  # what the message says to do
    assert fresh().load(tmp_path / "ckpt") == tmp_path / "ckpt"
    os.replace(tmp_path / "ckpt", tmp_path / ".ckpt.replaced")
    averager.save(tmp_path / "ckpt")  # a new save supersedes the interrupted one and clears it
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_no_checkpoint_at_all(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        fresh().load(tmp_path / "nowhere")


def test_truncated_and_foreign_files_are_named(trainer, tmp_path) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    shard = path / "rank-00000-of-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=rf"{shard} is not a readable safetensors file \(truncated or foreign\?\)"
    ):
        fresh().load(path)
    save_file({"something.else": torch.zeros(3)}, str(shard))
    with pytest.raises(CheckpointError, match=rf"{shard} has 92 bytes, the manifest says \d+: truncated, or not this"):
        fresh().load(path)
    replace_shard(path, shard.name, {"something.else": torch.zeros(100)})  # the manifest made to agree
    with pytest.raises(CheckpointError, match=rf"{shard} lacks tensor 'gain'"):
        fresh().load(path)
    (path / "shardavg.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"cannot read {path / 'shardavg.json'}"):
        fresh().load(path)
    (path / "shardavg.json").write_text(json.dumps({"format": "shardavg", "version": 99}))
    with pytest.raises(CheckpointError, match="format version 99; this shardavg reads up to 6"):
        fresh().load(path)
    (path / "shardavg.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(CheckpointError, match="is not a shardavg checkpoint description"):
        fresh().load(path)


def test_a_checkpoint_of_another_model_lists_what_differs(trainer, tmp_path) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    other = TiedNet()
    other.block.up = nn.Linear(6, 12)  # mis-shaped (and down no longer fits either)
    other.block.down = nn.Linear(12, 6)
    other.extra = nn.Parameter(torch.zeros(2))  # missing from the checkpoint
    del other.gain  # unexpected in the checkpoint
    averager = WeightAverager(other, EMA(decay=0.9))
    with pytest.raises(CheckpointError) as caught:
        averager.load(path)
    message = str(caught.value)
    assert "missing ['extra']" in message and "unexpected ['gain']" in message
    assert "block.up.weight: checkpoint (10, 6) vs model (12, 6)" in message


def test_missing_and_unexpected_tensors_only_warn_when_not_strict(trainer, tmp_path) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    model = TiedNet()
    model.extra = nn.Parameter(torch.zeros(2))
    averager = WeightAverager(model, EMA(decay=0.9))
    with pytest.warns(UserWarning, match=r"missing \['extra'\] \(averaged from the live weights on\), unexpected \[\]"):
        averager.load(path, strict=False)
    assert averager.num_updates == 5
    assert torch.equal(averager.full_state_dict()["extra"], torch.zeros(2))  # started from the live value


def test_a_different_rule_raises_unless_not_strict(trainer, tmp_path) -> None:
    path = trained(trainer, rule=EMA(decay=0.999)).save(tmp_path / "ckpt")
    averager = fresh(EMA(decay=0.9999))
    with pytest.raises(
        CheckpointError,
        match=r"averaged with rule \{'kind': 'ema', 'decay': 0.999, 'warmup': None\}, "
        r"this averager has .*0.9999.*pass strict=False",
    ):
        averager.load(path)
    assert averager.num_updates == 0  # nothing was loaded
    with pytest.warns(UserWarning, match="averaged with rule"):
        averager.load(path, strict=False)
    assert averager.num_updates == 5


def test_tensors_stored_differently_are_refused(trainer, tmp_path) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError, match=r"stores tensors differently.*frozen.proj.bias \(averaged here, live in the checkpoint\)"
    ):
        fresh(include_frozen=True).load(path)


def test_a_pickle_in_place_of_a_shard_is_refused_and_never_run(trainer, tmp_path) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    marker = tmp_path / MARKER_NAME
    (path / "rank-00000-of-00001.safetensors").write_bytes(pickle.dumps(Pwn(marker)))
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        fresh().load(path)
    result = subprocess.run(
        [sys.executable, "-m", "shardavg", "export", str(path), str(tmp_path / "out")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "not a readable safetensors file" in result.stderr
    assert not marker.exists()


# ----------------------------------------------------------------------------- DCP


def test_dcp_round_trip_and_state_dict_checks(trainer, tmp_path) -> None:
    averager = trained(trainer, rule=SWA())
    dcp.save({"ema": averager}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    restored = fresh(SWA())
    dcp.load({"ema": restored}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert (restored.step, restored.num_updates) == (5, 5)
    assert_same_average(restored, averager)

    state = {"ema": fresh(EMA(decay=0.9)).state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    other_rule = fresh(EMA(decay=0.9))
    with pytest.raises(CheckpointError, match=r"averaged with rule \{'kind': 'swa'\}"):
        other_rule.load_state_dict(state["ema"])
    with pytest.warns(UserWarning, match="averaged with rule"):
        other_rule.load_state_dict(state["ema"], strict=False)
    with pytest.raises(CheckpointError, match="needs 'meta' and a 'tensors' dict"):
        other_rule.load_state_dict({"weights": 1})


def test_dcp_metadata_that_asks_for_code_is_refused(trainer, tmp_path) -> None:
    averager = trained(trainer)
    dcp.save({"ema": averager}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    marker = tmp_path / MARKER_NAME
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Pwn(marker)))
    result = subprocess.run(
        [sys.executable, "-m", "shardavg", "inspect", str(tmp_path / "dcp")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "asks to load posix.system" in result.stderr and "refused" in result.stderr
    assert not marker.exists()


def test_a_dcp_entry_holding_a_pickled_object_is_refused(tmp_path) -> None:
    marker = tmp_path / MARKER_NAME
    dcp.save(
        {"ema": {"meta": Pwn(marker), "tensors": {"w": torch.zeros(2)}}},
        checkpoint_id=str(tmp_path / "dcp"),
        no_dist=True,
    )
    result = subprocess.run(
        [sys.executable, "-m", "shardavg", "inspect", str(tmp_path / "dcp")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "cannot read ema.meta" in result.stderr
    assert not marker.exists()


# ----------------------------------------------------------------------------- export


def test_export_single_file_with_metadata(trainer, tmp_path) -> None:
    averager = trained(trainer)
    out = averager.export(tmp_path / "export")
    assert sorted(os.listdir(out)) == ["model.safetensors", "provenance.json"]
    state = load_file(str(out / "model.safetensors"))
    TiedNet().load_state_dict(state, strict=True)
    reference = averager.full_state_dict()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        metadata = json.loads(handle.metadata()["shardavg"])
    assert metadata["rule"] == {"kind": "ema", "decay": 0.9, "warmup": None} and metadata["num_updates"] == 5


def test_export_shards_with_an_index_and_casts(trainer, tmp_path) -> None:
    averager = trained(trainer)
    out = averager.export(tmp_path / "export", max_shard_size=300, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert re.fullmatch(rf"model-[0-9a-f]{{12}}-00001-of-{len(files):05d}\.safetensors", files[0])  # its export id
    state = {}
    for name in files:
        part = load_file(str(out / name))
        assert sum(t.nbytes for t in part.values()) <= 300 or len(part) == 1
        state.update(part)
    assert set(state) == set(index["weight_map"]) == set(TiedNet().state_dict())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert state["embed.weight"].dtype == torch.bfloat16
    assert state["block.norm.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(state["head.weight"], state["embed.weight"])
    reference = averager.full_state_dict()
    assert torch.equal(state["block.up.weight"], reference["block.up.weight"].bfloat16())
    TiedNet().load_state_dict(state, strict=True)


def test_export_refuses_bad_arguments(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=1)
    with pytest.raises(ValueError, match="max_shard_size must be a positive size"):
        averager.export(tmp_path / "x", max_shard_size="lots")
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        averager.export(tmp_path / "x", dtype=torch.int8)
    with pytest.raises(RuntimeError, match="no update has been applied yet"):
        fresh().export(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5 kb") == 1500
    assert parse_size(1024) == 1024
    for bad in ("", "0GB", "-1MB", "5 parsecs", 0, True):
        with pytest.raises(ValueError):
            parse_size(bad)


# ----------------------------------------------------------------------------- CLI


def cli(*args: str) -> subprocess.CompletedProcess:
    return in_process_cli(*args)


def test_the_module_runs_as_a_command() -> None:
    shown = subprocess.run([sys.executable, "-m", "shardavg", "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: shardavg"), shown.stderr


def test_cli_inspect_and_export_both_layouts(trainer, tmp_path) -> None:
    averager = trained(trainer)
    averager.save(tmp_path / "runs", keep_last=3)
    dcp.save({"ema": averager}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    reference = averager.full_state_dict()
    for source in (tmp_path / "runs", tmp_path / "dcp"):
        shown = cli("inspect", str(source))
        assert shown.returncode == 0, shown.stderr
        assert "step         5" in shown.stdout and "num_updates  5 (0 skipped" in shown.stdout
        assert '"decay": 0.9' in shown.stdout and "replicated on 1 rank(s)" in shown.stdout
        assert "tensors      13: 8 average, 3 copy, 2 live" in shown.stdout
        assert "bytes        1148" in shown.stdout
        out = tmp_path / f"out-{source.name}"
        written = cli("export", str(source), str(out), "--max-shard-size", "400B")
        assert written.returncode == 0, written.stderr
        index = json.loads((out / "model.safetensors.index.json").read_text())
        state = {}
        for name in set(index["weight_map"].values()):
            state.update(load_file(str(out / name)))
        TiedNet().load_state_dict(state, strict=True)
        assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_cli_help_and_errors(tmp_path) -> None:
    shown = cli("--help")
    assert shown.returncode == 0
    assert "write the full averaged model as safetensors" in shown.stdout  # each command with what it does
    assert "print what a checkpoint holds" in shown.stdout
    export_help = " ".join(cli("export", "--help").stdout.split())  # argparse wraps lines by terminal width
    for shown_text in (
        "usage: shardavg export",
        "CKPT_DIR OUT",
        "--max-shard-size MAX_SHARD_SIZE largest file before splitting",
        "--dtype {float32,bfloat16,float16} cast floating tensors",
        "--key KEY the averager's key in a DCP checkpoint (default ema)",
    ):
        assert shown_text in export_help, (shown_text, export_help)
    inspect_help = cli("inspect", "--help").stdout
    assert "usage: shardavg inspect" in inspect_help and "--key" in inspect_help and "--dtype" not in inspect_help
    bare = cli()
    assert bare.returncode == 2 and "the following arguments are required: command" in bare.stderr
    missing = cli("inspect", str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("shardavg: error:") and "no checkpoint at" in missing.stderr
    (tmp_path / "plain").mkdir()
    not_one = cli("inspect", str(tmp_path / "plain"))
    assert not_one.returncode == 2 and "neither a shardavg checkpoint" in not_one.stderr
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    wrong_key = cli("inspect", str(tmp_path / "dcp"))
    assert wrong_key.returncode == 2 and "no averager under key 'ema' (top-level keys: ['model'])" in wrong_key.stderr


@pytest.mark.parametrize("stager", ["default", "writer"])
def test_an_async_dcp_save_in_one_process_holds_the_state_at_the_call(tmp_path, stager) -> None:
    """Without a process group the averager offers plain tensors, which both of DCP's copiers
    stage: updates while the request is held in flight change nothing it saves."""
    import threading

    from conftest import Trainer
    from scenario_async import GatedWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    torch.manual_seed(0)
    model = TiedNet()
    trainer, avg = Trainer(model), WeightAverager(model, {"ema": EMA(decay=0.8), "swa": SWA()})
    for _ in range(3):
        trainer.step()
        avg.update()
    want = {name: avg.full_state_dict(name) for name in ("ema", "swa")}
    gate = threading.Event()
    staging = DefaultStager(StagingOptions(False, False, False, False)) if stager == "default" else None
    future = dcp.async_save(
        {"avg": avg}, storage_writer=GatedWriter(tmp_path / "ckpt", gate), async_stager=staging, no_dist=True
    )
    for _ in range(3):
        trainer.step()
        avg.update()
    assert not future.done()
    gate.set()
    future.result()
    torch.manual_seed(0)
    loaded = WeightAverager(TiedNet(), {"ema": EMA(decay=0.8), "swa": SWA()})
    dcp.load({"avg": loaded}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert loaded.num_updates == 3
    for name, state in want.items():
        got = loaded.full_state_dict(name)
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state), name
