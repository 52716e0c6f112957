"""Nothing of the user's is lost: save, export and the CLI replace only what shardavg wrote,
refuse what is in the way, and keep two writers of one path apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import TiedNet
from helpers import fresh, in_process_cli, trained
from safetensors.torch import load_file, save_file

from shardavg import EMA, CheckpointError, PostHocEMA, WeightAverager
from shardavg.checkpoints.ownership import TargetLock
from shardavg.cli import main as cli_main

USER_FILES = {"config.json": "{}", "train.log": "step 1\n", "model_ckpt/optimizer.pt": "opaque"}
HF_FOLDER = {"config.json": "{}", "tokenizer.json": "{}", "generation_config.json": "{}", "README.md": "# a model\n"}


def put(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def intact(root: Path, files: dict[str, str]) -> bool:
    return all((root / name).read_text() == text for name, text in files.items())


def cli(*args: str) -> subprocess.CompletedProcess:
    return in_process_cli(*args)


def test_save_refuses_a_directory_holding_the_users_files(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    put(tmp_path / "run", USER_FILES)
    foreign = r"holds files shardavg did not write \(config.json, model_ckpt, train.log\)"
    with pytest.raises(CheckpointError, match=foreign):
        averager.save(tmp_path / "run")
    assert intact(tmp_path / "run", USER_FILES)
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no staging or lock left behind
    (tmp_path / "empty").mkdir()
    assert averager.save(tmp_path / "empty") == tmp_path / "empty"  # an empty directory is fine
    # keep_last writes step-* checkpoints beside the user's files and touches nothing else
    path = averager.save(tmp_path / "run", keep_last=1)
    assert path == tmp_path / "run" / "step-000000003" and intact(tmp_path / "run", USER_FILES)
    assert fresh().load(tmp_path / "run") == path


def test_save_refuses_a_regular_file_and_a_checkpoint_with_a_foreign_file(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    (tmp_path / "notes").write_text("mine")
    for keep_last in (None, 2):
        with pytest.raises(CheckpointError, match="notes exists and is not a folder: shardavg will not replace it"):
            averager.save(tmp_path / "notes", keep_last=keep_last)
    assert sorted(os.listdir(tmp_path)) == ["notes"] and (tmp_path / "notes").read_text() == "mine"
    averager.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "my-notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds files shardavg did not write \(my-notes.txt\)"):
        averager.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "my-notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="is a single checkpoint; keep_last=K writes step-"):
        averager.save(tmp_path / "ckpt", keep_last=2)
    assert fresh().load(tmp_path / "ckpt").name == "ckpt"  # still loads


def test_a_provenance_file_shardavg_did_not_write_is_never_replaced(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=2)
    folder = tmp_path / "model"
    notes = {"provenance.json": '{"source": "my notes"}'}
    put(folder, notes)
    with pytest.raises(CheckpointError, match="provenance.json was not written by shardavg"):
        averager.export(folder)
    assert sorted(os.listdir(folder)) == ["provenance.json"] and intact(folder, notes)


def test_export_writes_beside_a_hugging_face_folder_and_replaces_only_its_own_weights(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    folder = tmp_path / "hf-model"
    put(folder, HF_FOLDER)
    averager.export(folder, max_shard_size=300)  # split: several files and an index
    split = sorted(name for name in os.listdir(folder) if name.startswith("model"))
    assert len(split) > 2 and "model.safetensors.index.json" in split and intact(folder, HF_FOLDER)
    averager.export(folder)  # one file now: the split export's files are its own, so they go
    written = ["model.safetensors", "provenance.json"]
    assert sorted(os.listdir(folder)) == sorted([*HF_FOLDER, *written]) and intact(folder, HF_FOLDER)
    TiedNet().load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)

    theirs = tmp_path / "their-model"
    put(theirs, HF_FOLDER)
    save_file({"w": torch.zeros(2)}, str(theirs / "model.safetensors"))  # the user's raw weights
    with pytest.raises(CheckpointError, match=r"holds weight files shardavg did not write \(model.safetensors\)"):
        averager.export(theirs)
    assert torch.equal(load_file(str(theirs / "model.safetensors"))["w"], torch.zeros(2))
    with pytest.raises(CheckpointError, match="is a checkpoint: export into a model folder of its own"):
        averager.export(averager.save(tmp_path / "ckpt"))
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        averager.export(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "mine"


def test_cli_export_never_wipes_the_run_folder_or_the_checkpoint(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    run = tmp_path / "run"
    put(run, USER_FILES)
    averager.save(run / "ema")
    into_checkpoint = cli("export", str(run / "ema"), str(run / "ema"))
    assert into_checkpoint.returncode == 2 and "is a checkpoint" in into_checkpoint.stderr
    below_checkpoint = cli("export", str(run / "ema"), str(run / "ema" / "out"))
    assert below_checkpoint.returncode == 2 and "is inside the checkpoint" in below_checkpoint.stderr
    assert sorted(os.listdir(run / "ema")) == ["rank-00000-of-00001.safetensors", "shardavg.json"]
    beside = cli("export", str(run / "ema"), str(run))  # the run folder: the export goes beside the user's files
    assert beside.returncode == 0, beside.stderr
    assert intact(run, USER_FILES) and fresh().load(run / "ema") == run / "ema"
    assert sorted(os.listdir(run)) == sorted(
        ["config.json", "train.log", "model_ckpt", "ema", "model.safetensors", "provenance.json"]
    )


def test_keep_last_after_a_restart_from_an_earlier_step_keeps_what_it_saved(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=0)
    for step in (10, 20, 30):
        trainer.step()
        averager.update(step=step)
        averager.save(tmp_path, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000000020", "step-000000030"]
    restarted = fresh()
    restarted.load(tmp_path / "step-000000020")  # the run resumes from step 20
    restarted.update(step=25)
    with pytest.warns(UserWarning, match=r"holds later steps \['step-000000030'\].*this save is now the newest"):
        path = restarted.save(tmp_path, keep_last=2)
    assert path == tmp_path / "step-000000025" and path.is_dir()  # not pruned right after it was written
    assert sorted(os.listdir(tmp_path)) == ["step-000000025", "step-000000030"]
    assert fresh().load(tmp_path) == path  # the newest save, not the highest step of the abandoned run
    restarted.update(step=26)
    with pytest.warns(UserWarning, match="holds later steps"):
        restarted.save(tmp_path, keep_last=2)  # the abandoned run's step 30 is now the oldest save
    assert sorted(os.listdir(tmp_path)) == ["step-000000025", "step-000000026"]


def test_prune_removes_only_its_own_checkpoints_and_staging(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=1)
    averager.save(tmp_path, keep_last=1)
    (tmp_path / "step-000000001" / "notes.txt").write_text("mine")  # the user's file inside an old checkpoint
    (tmp_path / ".step-000000007.incomplete").mkdir()  # not a staging directory of shardavg's
    (tmp_path / ".step-000000007.incomplete" / "data.bin").write_text("mine")
    for _ in range(2):
        trainer.step()
        averager.update()
        averager.save(tmp_path, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == [".step-000000007.incomplete", "step-000000001", "step-000000003"]
    assert (tmp_path / "step-000000001" / "notes.txt").read_text() == "mine"
    crashed = tmp_path / ".step-000000009.incomplete"  # what a crashed save leaves: the marker and shards
    crashed.mkdir()
    (crashed / ".shardavg-staging").touch()
    (crashed / "rank-00000-of-00001.safetensors").write_bytes(b"partial")
    trainer.step()
    averager.update()
    averager.save(tmp_path, keep_last=1)
    assert not crashed.exists() and (tmp_path / ".step-000000007.incomplete" / "data.bin").exists()


def test_steps_only_go_forward(trainer) -> None:
    averager = trained(trainer, steps=0)
    trainer.step()
    assert averager.update(step=5)
    before = averager.full_state_dict()
    for bad in (3, 5, -1):
        with pytest.raises(ValueError, match=rf"update\(step={bad}\) after step 5: steps must increase"):
            averager.update(step=bad)
    assert (averager.step, averager.num_updates) == (5, 1)
    assert all(torch.equal(value, before[name]) for name, value in averager.full_state_dict().items())
    fresh_one = fresh()
    with pytest.raises(ValueError, match=r"update\(step=-3\)"):
        fresh_one.update(step=-3)
    assert fresh_one.update(step=0) and fresh_one.step == 0  # the first update may be at step 0


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    runs = tmp_path / "runs"
    runs.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(runs)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for write in (lambda: averager.save(runs, keep_last=2), lambda: averager.export(runs)):
            with pytest.raises(CheckpointError, match=rf"being written by another process \(pid {holder.pid} on "):
                write()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert os.listdir(tmp_path / "runs") == [".shardavg.lock"]  # nothing written; the holder died holding it
    averager.save(tmp_path / "runs", keep_last=2)  # the kernel released the dead holder's lock
    assert sorted(os.listdir(tmp_path / "runs")) == ["step-000000003"]
    with TargetLock.beside(tmp_path / "ckpt"), pytest.raises(CheckpointError, match="being written by another"):
        averager.save(tmp_path / "ckpt")  # a single checkpoint's lock, taken here in the same process
    assert sorted(os.listdir(tmp_path)) == ["runs"]


HOLD_LOCK = """
import sys, time
from pathlib import Path
from shardavg.checkpoints.ownership import TargetLock
with TargetLock.inside(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_checkpoint_saved_before_any_update_holds_no_average(trainer, tmp_path) -> None:
    averager = WeightAverager(trainer.model, EMA(decay=0.9), start_step=1000)
    trainer.step()
    assert not averager.update(step=500)
    path = averager.save(tmp_path / "early")
    shown = cli("inspect", str(path))
    assert shown.returncode == 0 and "saved before the first update: no average yet" in shown.stdout
    exported = cli("export", str(path), str(tmp_path / "out"))
    assert exported.returncode == 2 and "saved before any update was applied" in exported.stderr
    assert not (tmp_path / "out").exists()
    restored = WeightAverager(TiedNet(), EMA(decay=0.9), start_step=1000)
    restored.load(path)
    assert restored.num_updates == 0
    with pytest.raises(RuntimeError, match="no update has been applied yet"):
        restored.export(tmp_path / "out")


def test_shadows_start_as_zeros_not_stray_memory(trainer, tmp_path) -> None:
    averager = WeightAverager(trainer.model, EMA(decay=0.9), start_step=10)
    path = averager.save(tmp_path / "early")
    stored = load_file(str(path / "rank-00000-of-00001.safetensors"))
    manifest = json.loads((path / "shardavg.json").read_text())
    averaged = [t["name"] for t in manifest["tensors"] if t["role"] == "average"]
    assert averaged and all(not stored[name].any() for name in averaged)


def test_a_target_must_name_a_directory_of_its_own(trainer, tmp_path, monkeypatch, capsys) -> None:
    averager = trained(trainer, steps=3)
    monkeypatch.chdir(tmp_path)
    put(tmp_path, USER_FILES)
    for where in (".", "..", "run/..", ""):
        with pytest.raises(ValueError, match=r"save: (the path is empty|'.*' names the current or a parent)"):
            averager.save(where)
    with pytest.raises(ValueError, match="save: the path is empty"):
        averager.save("", keep_last=2)
    with pytest.raises(ValueError, match="export: the path is empty"):
        averager.export("")
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", "train.log", "model_ckpt"]) and intact(
        tmp_path, USER_FILES
    )
    checkpoint = averager.save(tmp_path / "ckpt")
    for args in (["export", str(checkpoint), ""], ["export", "", "out"], ["inspect", ""]):
        capsys.readouterr()
        assert cli_main(args) == 2, args
        said = capsys.readouterr().err
        assert said.startswith("shardavg: error:") and len(said.strip().splitlines()) == 1 and "empty" in said, said
    assert averager.save(".", keep_last=2) == Path("step-000000003")  # step checkpoints into the current folder
    assert intact(tmp_path, USER_FILES)


def test_nothing_is_written_inside_a_checkpoint_or_a_snapshot(trainer, tmp_path, capsys) -> None:
    averager = trained(trainer, steps=3)
    checkpoint = averager.save(tmp_path / "ckpt")
    for write in (
        lambda: averager.save(checkpoint / "nested"),
        lambda: averager.save(checkpoint / "deeper" / "still", keep_last=2),
        lambda: averager.export(checkpoint / "model"),
    ):
        with pytest.raises(CheckpointError, match=rf"inside the checkpoint {checkpoint}"):
            write()
    assert sorted(os.listdir(checkpoint)) == ["rank-00000-of-00001.safetensors", "shardavg.json"]
    posthoc = PostHocEMA(trainer.model, snapshot_every=2, directory=tmp_path / "snapshots")
    for _ in range(4):
        trainer.step()
        posthoc.update()
    snapshot = tmp_path / "snapshots" / "snapshot-000000004"
    capsys.readouterr()
    code = cli_main(["posthoc", str(tmp_path / "snapshots"), str(snapshot / "sub"), "--sigma-rel", "0.07"])
    said = capsys.readouterr().err
    assert code == 2 and f"inside the checkpoint {snapshot}" in said and len(said.strip().splitlines()) == 1, said
    assert sorted(os.listdir(snapshot)) == ["rank-00000-of-00001.safetensors", "shardavg.json"]
    assert cli_main(["posthoc", str(tmp_path / "snapshots"), "", "--sigma-rel", "0.07"]) == 2
    assert "OUT is empty" in capsys.readouterr().err
    beside = tmp_path / "snapshots" / "ema-0.08"  # beside the snapshots is fine: it is no snapshot
    assert cli_main(["posthoc", str(tmp_path / "snapshots"), str(beside), "--sigma-rel", "0.08"]) == 0
    posthoc.update()  # a resumed run still finds its snapshots its own
    assert (beside / "model.safetensors").is_file()


def test_a_cli_usage_mistake_is_one_line(capsys) -> None:
    for args in (["export"], ["posthoc", "dir", "out", "--step", "x"], ["frobnicate"], ["inspect", "a", "--nope"]):
        assert cli_main(args) == 2, args
        said = capsys.readouterr().err
        assert said.startswith("shardavg: error:") and len(said.strip().splitlines()) == 1, said
    assert cli_main(["--help"]) == 0 and "usage: shardavg" in capsys.readouterr().out
