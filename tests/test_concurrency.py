"""A second process at the same moment: a file planted at a lock's name, processes racing for one
lock, and readers (``load``, the offline reader, ``shardavg export``) running while another
process saves into the very checkpoint they read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from concurrent_saves import OPTIONS, Reference
from harness import TiedNet
from helpers import fresh, trained

from shardavg import SWA, CheckpointError, PostHocEMA, WeightAverager
from shardavg.checkpoints.ownership import TargetLock
from shardavg.cli import main as cli_main
from shardavg.offline.saved_average import SavedAverage

ROOT = Path(__file__).resolve().parents[1]


def planted(tmp_path: Path, name: str, kind: str) -> tuple[Path, Path]:
    """A user's file ``precious.txt`` and, at the lock path ``name``, a link to it or a file of the user's."""
    precious = tmp_path / "precious.txt"
    tmp_path.mkdir(parents=True, exist_ok=True)
    precious.write_text("the user's data\n")
    lock = tmp_path / name
    lock.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        lock.symlink_to(precious)
    else:
        lock.write_text("my notes, not a lock\n")
    return precious, lock


def writers(averager: WeightAverager, tmp_path: Path, capsys) -> dict:
    """Every way shardavg writes under a lock: the lock path each takes, and the write (the CLI's
    one-line refusal raised as the CheckpointError it reports)."""
    checkpoint = averager.save(tmp_path / "for-cli")

    def cli_export() -> None:
        capsys.readouterr()
        if cli_main(["export", str(checkpoint), str(tmp_path / "cli-model")]):
            said = capsys.readouterr().err
            assert said.startswith("shardavg: error:") and len(said.strip().splitlines()) == 1, said
            raise CheckpointError(said)

    return {
        "save": (tmp_path / "run" / ".ckpt.lock", lambda: averager.save(tmp_path / "run" / "ckpt")),
        "keep_last": (tmp_path / "run" / ".shardavg.lock", lambda: averager.save(tmp_path / "run", keep_last=2)),
        "export": (tmp_path / "model" / ".shardavg.lock", lambda: averager.export(tmp_path / "model")),
        "cli export": (tmp_path / "cli-model" / ".shardavg.lock", cli_export),
    }


@pytest.mark.parametrize("kind", ["link", "user file"])
def test_a_link_or_a_users_file_at_a_lock_path_is_refused_and_left_alone(trainer, tmp_path, capsys, kind) -> None:
    averager = trained(trainer, steps=3)
    for what, (lock_path, write) in writers(averager, tmp_path, capsys).items():
        precious, lock = planted(tmp_path, str(lock_path.relative_to(tmp_path)), kind)
        before = precious.stat()
        refusal = "is a link, where shardavg keeps" if kind == "link" else "was not written by shardavg"
        with pytest.raises(CheckpointError, match=refusal) as refused:
            write()
        assert str(lock) in str(refused.value), what
        assert precious.read_text() == "the user's data\n" and precious.stat().st_mtime_ns == before.st_mtime_ns, what
        if kind == "link":
            assert lock.is_symlink() and lock.resolve() == precious, what
        else:
            assert lock.read_text() == "my notes, not a lock\n", what
        lock.unlink()
        precious.unlink()
        write()  # once it is out of the way
        assert not lock.exists(), f"{what}: the lock file is removed once released"


def test_a_link_at_the_lock_names_it_and_says_what_to_do(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    precious, lock = planted(tmp_path, ".ckpt.lock", "link")
    with pytest.raises(CheckpointError, match=rf"{lock} is a link, where shardavg keeps .*ckpt's lock: .* remove the"):
        averager.save(tmp_path / "ckpt")
    precious, lock = planted(tmp_path / "elsewhere", ".ckpt.lock", "user file")
    with pytest.raises(CheckpointError, match=r"was not written by shardavg \(holds 'my notes.*neither overwrite nor"):
        averager.save(tmp_path / "elsewhere" / "ckpt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".ckpt.lock").touch()  # empty and unlocked for longer than a lock is being created
    with pytest.raises(CheckpointError, match=r"\(an empty file\)"):
        averager.save(tmp_path / "empty" / "ckpt")
    assert (tmp_path / "empty" / ".ckpt.lock").exists()


def test_posthoc_snapshots_and_accelerate_checkpoints_refuse_a_planted_link(model, tmp_path) -> None:
    precious, lock = planted(tmp_path, "snapshots/.snapshot-000000002.lock", "link")
    posthoc = PostHocEMA(model, snapshot_every=2, directory=tmp_path / "snapshots")
    posthoc.update()
    with pytest.raises(CheckpointError, match="is a link"):
        posthoc.update()  # the second update writes snapshot 2
    assert precious.read_text() == "the user's data\n" and lock.is_symlink()

    from accelerate import Accelerator

    from shardavg.integrations.accelerate import attach

    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(TiedNet())
    averager = WeightAverager(prepared, SWA())
    averager.update()
    attach(accelerator, averager)
    precious, lock = planted(tmp_path / "acc", "state/.shardavg.lock", "link")
    with pytest.raises(CheckpointError, match="is a link"):
        accelerator.save_state(str(tmp_path / "acc" / "state"))
    assert precious.read_text() == "the user's data\n" and lock.is_symlink()


RACE = """
import sys, time
from pathlib import Path
from shardavg import CheckpointError
from shardavg.checkpoints.ownership import TargetLock
target, rounds = Path(sys.argv[1]), int(sys.argv[2])
won = busy = 0
deadline = time.monotonic() + 60
while won + busy < rounds and time.monotonic() < deadline:
    try:
        with TargetLock.beside(target):
            won += 1
            time.sleep(0.001)
    except CheckpointError as error:
        if "being written by another process" not in str(error):
            print("WRONG", error, flush=True)
            sys.exit(1)
        busy += 1
print(won, busy)
"""


def test_processes_racing_for_one_lock_are_refused_as_busy_never_as_foreign(tmp_path) -> None:
    """Creating the lock file and taking the lock are two steps: a process that finds the file
    between them must wait or call it busy, never refuse it as someone's file."""
    racers = [
        subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path / "ckpt"), "300"], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [racer.communicate(timeout=120)[0] for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), outputs
    won = sum(int(output.split()[0]) for output in outputs)
    assert won > 0 and not (tmp_path / ".ckpt.lock").exists(), outputs
    with TargetLock.beside(tmp_path / "ckpt"):  # and it is free again
        pass


# --------------------------------------------------------------------------- readers during a save


def whole(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return state.keys() == want.keys() and all(torch.equal(state[name], want[name]) for name in want)


@pytest.fixture
def saving(tmp_path):
    """Start a process saving into ``tmp_path/<kind>`` as fast as it can; stop it at the end."""
    started = []

    def start(kind: str) -> Path:
        target = tmp_path / kind
        script = ROOT / "tests_distributed" / "concurrent_saves.py"
        writer = subprocess.Popen(
            [sys.executable, str(script), str(target), str(tmp_path / "stop"), kind], stdout=subprocess.PIPE, text=True
        )
        started.append(writer)
        assert writer.stdout.readline().strip() == "saved"
        return target

    yield start
    (tmp_path / "stop").touch()
    for writer in started:
        writer.wait(timeout=60)
        writer.stdout.close()
        assert writer.returncode == 0


LOADS = 1200  # per kind of target; before the fix about 1% of loads were torn


@pytest.mark.parametrize("kind", ["single", "keep_last"])
def test_load_gets_one_save_whole_while_another_process_saves_there(saving, kind) -> None:
    target, reference, outcomes = saving(kind), Reference(), Counter()
    averager = WeightAverager(TiedNet(), SWA(), **OPTIONS)
    seen = set()
    for _ in range(LOADS):
        averager.load(target)
        state, n = averager.full_state_dict(), averager.num_updates
        outcomes["whole" if whole(state, reference(n)) and averager.step == n else "torn"] += 1
        seen.add(n)
    print(kind, dict(outcomes), f"{len(seen)} different saves read")
    assert outcomes["whole"] == LOADS, outcomes
    assert len(seen) > 20  # the writer really was saving throughout


def test_the_offline_reader_and_cli_export_get_one_save_whole_while_another_process_saves(saving, tmp_path) -> None:
    target, reference, outcomes = saving("single"), Reference(), Counter()
    names = list(reference(1))
    for _ in range(600):
        saved = SavedAverage(target)
        n = saved.description.num_updates
        state = {name: saved.read(name) for name in saved.tensors if name in names}
        saved.close()
        outcomes["whole" if whole(state, {k: v for k, v in reference(n).items() if k in state}) else "torn"] += 1
    for case in range(60):
        out = tmp_path / f"export-{case}"
        assert cli_main(["export", str(target), str(out)]) == 0
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as handle:
            n = __import__("json").loads(handle.metadata()["shardavg"])["num_updates"]
            state = {name: handle.get_tensor(name) for name in handle.keys()}
        want = reference(n)
        outcomes["cli whole" if all(torch.equal(state[k], want[k]) for k in want) else "cli torn"] += 1
    print(dict(outcomes))
    assert outcomes == Counter({"whole": 600, "cli whole": 60}), outcomes


def test_a_reader_refuses_a_shard_of_another_save_under_the_right_name(trainer, tmp_path) -> None:
    averager = trained(trainer, steps=3)
    first = averager.save(tmp_path / "first")
    trainer.step()
    averager.update()
    second = averager.save(tmp_path / "second")
    shard = "rank-00000-of-00001.safetensors"
    os.replace(first / shard, second / shard)  # same size and names: only the save id tells them apart
    with pytest.raises(CheckpointError, match=rf"{second / shard} belongs to save .*files of two saves are mixed"):
        fresh().load(second)
    assert cli_main(["inspect", str(second)]) == 2


def test_a_checkpoint_pruned_while_opened_is_followed_to_the_newest(trainer, tmp_path) -> None:
    """The reader opened a step checkpoint that a save then pruned: it reads the newer save instead."""
    from shardavg.checkpoints.reading import OpenCheckpoint, open_checkpoint

    averager = trained(trainer, steps=2)
    averager.save(tmp_path, keep_last=1)
    opened = OpenCheckpoint(tmp_path / "step-000000002")
    trainer.step()
    averager.update()
    averager.save(tmp_path, keep_last=1)  # prunes step 2 while it is open
    with pytest.raises(CheckpointError, match="replaced by a newer save"):
        opened.shard(0)
    opened.close()
    with open_checkpoint(tmp_path) as newest:
        assert newest.description.num_updates == 3 and newest.path.name == "step-000000003"
    started = time.monotonic()
    assert fresh().load(tmp_path).name == "step-000000003" and time.monotonic() - started < 10
