"""The main job refuses a config that cannot run before it starts anything, with one message naming the key."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import deadline
from safetensors.torch import save_file

pytest.importorskip("yaml", reason="PyYAML (the main job's configs) is not installed (pip install -e '.[launch]')")
import yaml  # noqa: E402

from launch import checkpoints, train  # noqa: E402
from launch import job as jobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def refused(caplog, monkeypatch, *argv: str, world: int = 2) -> str:
    """The one error ``train.main`` logs; it must return 2 without starting a process group."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(train.engines, "init_distributed", lambda kind: pytest.fail("a process group was started"))
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="train"):
        assert train.main(list(argv)) == 2
    (message,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return message


def edited(tmp_path: Path, change) -> str:
    """configs/fsdp2.yaml with ``change(config)`` applied, as a new file."""
    config = yaml.safe_load((CONFIGS / "fsdp2.yaml").read_text())
    change(config)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


FSDP2 = str(CONFIGS / "fsdp2.yaml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "nowhere.yaml"], "cannot read config nowhere.yaml"),
        (["--config", FSDP2, "--set", "train.lrr=0.1"], "unknown config key 'train.lrr'"),
        (["--config", FSDP2, "--set", "trainer.lr=0.1"], "unknown config key 'trainer'"),
        (["--config", FSDP2, "--set", "train.lr=fast"], "config key 'train.lr' takes a float, got 'fast'"),
        (["--config", FSDP2, "--set", "steps"], "expected key=value"),
        (["--config", FSDP2, "--steps", "0"], "config key 'steps' must be at least 1"),
        (["--config", FSDP2, "--set", "engine=fsdp3"], "config key 'engine': 'fsdp3' is not one of"),
        (["--config", FSDP2, "--set", "dtype=float16"], "config key 'dtype': 'float16' is not float32 or bfloat16"),
        (["--config", FSDP2, "--data", "/no/such/text"], "config key 'data.path': /no/such/text does not exist"),
        (["--config", FSDP2, "--set", "data.heldout_fraction=1"], "'data.heldout_fraction' must be between 0 and 1"),
        (["--config", FSDP2, "--set", "averages.ema.kind=emma"], "config key 'averages.ema': unknown rule kind 'emma'"),
        (["--config", FSDP2, "--set", "averages.ema.decay=1.5"], "config key 'averages.ema': "),
        (["--config", FSDP2, "--set", "averages={}"], "config key 'averages' must name at least one average"),
        (["--config", FSDP2, "--set", "deepspeed=ds_zero3.json"], "'deepspeed' is for the zero3 engine, not fsdp2"),
        (["--config", str(CONFIGS / "zero3.yaml"), "--set", "deepspeed=gone.json"], "'deepspeed': cannot read"),
        (["--config", str(CONFIGS / "hsdp.yaml"), "--set", "hsdp.replicas=3"], "2 processes cannot form 3 replicas"),
        (["--config", FSDP2, "--set", "model.heads=0"], "config key 'model.heads' must be at least 1"),
        (["--config", FSDP2, "--set", "posthoc.sigma_rels=[0.05]"], "'posthoc.sigma_rels' needs at least two"),
        (["--config", FSDP2, "--set", "posthoc.sweep=[0.05, 0.5]"], "'posthoc.sweep': PowerEMA sigma_rel must be in"),
        (["--config", FSDP2, "--set", "posthoc.sweep=[0.05, 1.0e-200]"], "sigma_rel must be in [1e-06, 0.3003)"),
        (["--config", FSDP2, "--set", "posthoc.sigma_rels=[0.05, 1.0e-200]"], "'posthoc.sigma_rels': PowerEMA"),
        (["--config", FSDP2, "--set", "averages.power.sigma_rel=1.0e-200"], "'averages.power': PowerEMA sigma_rel"),
        (["--config", FSDP2, "--set", "posthoc.snapshot_every=-1"], "'posthoc.snapshot_every' must be from 0"),
        (["--config", FSDP2, "--set", "model.heads=3"], "'model.heads' (3) must divide 'model.dim' (128)"),
        (["--config", FSDP2, "--set", "train.lr=-1.0"], "'train.lr' must be a finite number > 0.0, got -1.0"),
        (["--config", FSDP2, "--set", "train.lr=.inf"], "'train.lr' must be a finite number > 0.0, got inf"),
        (["--config", FSDP2, "--set", "train.lr=.nan"], "'train.lr' must be a finite number > 0.0, got nan"),
        (["--config", FSDP2, "--set", "train.grad_clip=0"], "'train.grad_clip' must be a finite number > 0.0"),
        (["--config", FSDP2, "--set", "train.min_lr=0.1"], "'train.min_lr' (0.1) must not exceed 'train.lr'"),
        (["--config", FSDP2, "--set", "seed=100000000000000000000000"], "'seed' must be from 0 and at most 4,294,"),
        (["--config", FSDP2, "--set", "seed=-1"], "'seed' must be from 0"),
        (["--config", FSDP2, "--steps", "1000000000"], "'steps' must be at least 1 and at most 99,999,999"),
        (["--config", FSDP2, "--set", "train.batch_size=10000000"], "'train.batch_size' must be at least 1 and at"),
        (["--config", FSDP2, "--set", "model.context=100000"], "'model.context' (100000), 'model.dim' (128)"),
        (["--config", FSDP2, "--set", "data.heldout_fraction=.nan"], "'data.heldout_fraction' must be between 0"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(caplog, monkeypatch, argv, message) -> None:
    assert message in refused(caplog, monkeypatch, *argv)


TP, PP = str(CONFIGS / "fsdp2_tp.yaml"), str(CONFIGS / "pp.yaml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--config", FSDP2, "--set", "parallel.tp=2"],
            "'parallel.tp' is for the fsdp2_tp engine (1 otherwise), got 2",
        ),
        (["--config", FSDP2, "--set", "parallel.microbatches=2"], "'parallel.microbatches' are for the pp engine"),
        (["--config", TP, "--set", "parallel.tp=3"], "'parallel.tp' (3) must divide the 4 processes"),
        (
            ["--config", TP, "--set", "parallel.tp=4", "--set", "model.heads=2"],
            "'parallel.tp' (4) must divide 'model.heads' (2)",
        ),
        (["--config", TP, "--set", "parallel.tp=0"], "'parallel.tp' must be at least 1"),
        (["--config", PP, "--set", "parallel.pp=3"], "'parallel.pp' (3) must be at least 2 and divide the 4 processes"),
        (["--config", PP, "--set", "parallel.pp=4", "--set", "model.layers=2"], "'model.layers' (2) cannot fill them"),
        (
            ["--config", PP, "--set", "parallel.microbatches=3"],
            "'parallel.microbatches' (3) must divide 'train.batch_size' (16)",
        ),
    ],
)
def test_tensor_and_pipeline_parallel_degrees_must_fit_the_launch_and_the_model(
    caplog, monkeypatch, argv, message
) -> None:
    assert message in refused(caplog, monkeypatch, *argv, world=4)


ZERO3 = str(CONFIGS / "zero3.yaml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--config", ZERO3, "--set", "merge.last=2"],
            "config key 'merge.last': the zero3 engine's checkpoints are DeepSpeed's own, pickled states that "
            "shardavg merge never loads: set it to 0",
        ),
        (
            ["--config", ZERO3, "--set", "checkpoint.async=true"],
            "config key 'checkpoint.async': the zero3 engine saves DeepSpeed's own checkpoints, which DCP cannot "
            "save asynchronously: set it to false",
        ),
        (["--config", FSDP2, "--set", "checkpoint.async=1"], "config key 'checkpoint.async' takes a bool, got 1"),
        (["--config", FSDP2, "--set", "merge.last=-1"], "config key 'merge.last' must be from 0 and at most"),
        (["--config", FSDP2, "--set", "merge.last=two"], "config key 'merge.last' takes an int, got 'two'"),
        (
            ["--config", FSDP2, "--set", "merge.last=5"],
            "config key 'merge.last' (5) exceeds 'checkpoint.keep_last' (4): keep at least as many checkpoints",
        ),
        (
            ["--config", FSDP2, "--steps", "120", "--set", "merge.last=4"],  # checkpoints at 50, 100 and the last step
            "config key 'merge.last' (4): the run will end with the checkpoints of steps [50, 100, 120] only; "
            "lower it, or checkpoint more often ('checkpoint.every')",
        ),
        (
            ["--config", FSDP2, "--set", "checkpoint.every=1000", "--set", "merge={last: 4}"],
            "config key 'merge.last' (4): the run will end with the checkpoints of steps [600] only",
        ),
    ],
)
def test_a_merge_or_async_checkpoints_the_run_cannot_give_are_refused(caplog, monkeypatch, argv, message) -> None:
    assert message in refused(caplog, monkeypatch, *argv)


def test_a_resumed_run_counts_the_checkpoints_it_keeps_from_before(caplog, monkeypatch, tmp_path) -> None:
    """Resumed from step 8 with checkpoints at 4 and 8, a run to step 10 ends with three: merge.last 3
    fits, 4 set by the user does not, and the shipped default 4 merges those three."""
    dcp_checkpoint(tmp_path, 4), dcp_checkpoint(tmp_path, 8)
    argv = ["--config", FSDP2, "--out", str(tmp_path), "--resume", "--steps", "10"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    job = train.load_job(train.parse_args([*argv, "--set", "merge.last=3"]), world=2)
    assert job.resume_from == tmp_path / "checkpoints" / "step-00000008" and job.merge_last == 3
    assert train.load_job(train.parse_args(argv), world=2).merge_last == 3
    message = refused(caplog, monkeypatch, *argv, "--set", "merge.last=4")
    assert "config key 'merge.last' (4): the run will end with the checkpoints of steps [4, 8, 10] only" in message


@pytest.mark.parametrize(
    ("argv", "merges", "said"),
    [
        (
            ["--steps", "8"],
            1,
            "merge.last 4 (the config's default): the run will end with 1 checkpoint (step 8); merging that one",
        ),
        (
            ["--steps", "120"],
            3,
            "merge.last 4 (the config's default): the run will end with 3 checkpoints (steps 50, 100, 120); merging "
            "those",
        ),
        (["--steps", "8", "--set", "checkpoint.keep_last=2"], 1, "the run will end with 1 checkpoint (step 8)"),
        (["--steps", "200", "--set", "checkpoint.keep_last=2"], 2, "the run will end with 2 checkpoints (steps 150,"),
        ([], 4, None),  # the full run: steps 450 to 600
        (["--steps", "8", "--set", "merge.last=1"], 1, None),
        (["--steps", "8", "--set", "merge.last=0"], 0, None),
    ],
    ids=["steps-8", "steps-120", "keep-2-steps-8", "keep-2-steps-200", "full-run", "set-1", "set-0"],
)
def test_a_shipped_configs_merge_last_merges_what_a_short_run_has(caplog, monkeypatch, tmp_path, argv, merges, said):
    """The shipped configs' ``merge.last: 4`` is a default sized for their full run, an upper bound:
    a smoke run at any ``--steps`` merges the checkpoints it will have, saying so in one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO, logger="train"):
        job = train.load_job(train.parse_args(["--config", FSDP2, "--out", str(tmp_path / "out"), *argv]), world=2)
    assert job.merge_last == merges
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("merge.last")]
    assert len(lines) == (said is not None) and all(said in line for line in lines), lines


def test_a_merge_last_of_ones_own_yaml_is_required(caplog, monkeypatch, tmp_path) -> None:
    """The same ``merge.last: 4`` in a YAML of the user's own is theirs: a run that cannot give four
    checkpoints is refused, as with ``--set merge.last=4``."""
    mine = edited(tmp_path, lambda config: None)
    message = refused(caplog, monkeypatch, "--config", mine, "--steps", "8")
    assert message == (
        "config error: config key 'merge.last' (4): the run will end with the checkpoints of steps [8] only; lower "
        "it, or checkpoint more often ('checkpoint.every')"
    )
    assert "exceeds 'checkpoint.keep_last' (2)" in refused(
        caplog, monkeypatch, "--config", FSDP2, "--set", "merge.last=4", "--set", "checkpoint.keep_last=2"
    )


def test_nothing_to_merge_or_a_zero3_run_skips_a_default_merge_in_one_line(caplog, tmp_path) -> None:
    """A run that will end with no checkpoint of its own (resumed at its last step from elsewhere),
    or a zero3 run (DeepSpeed's checkpoints), skips the shipped default's merge, saying so; a
    ``merge.last`` the user chose for zero3 stays refused."""
    cfg = yaml.safe_load((CONFIGS / "fsdp2.yaml").read_text()) | {"steps": 8}
    elsewhere = dcp_checkpoint(tmp_path / "elsewhere", 8)
    zero3 = cfg | {"engine": "zero3"}
    with caplog.at_level(logging.INFO, logger="train"):
        assert jobs.plan_merge(cfg, tmp_path / "out" / "checkpoints", elsewhere, required=False) == 0
        assert jobs.plan_merge(zero3, tmp_path / "out" / "checkpoints", None, required=False) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "train"] == [
        "merge.last 4 (the config's default): the run will end with no checkpoint; no merge",
        "merge.last 4 (the config's default): the zero3 engine's checkpoints are DeepSpeed's own, pickled states "
        "that shardavg merge never loads; no merge",
    ]
    with pytest.raises(jobs.ConfigError, match="config key 'merge.last': the zero3 engine's checkpoints are"):
        jobs.plan_merge(zero3, tmp_path / "out" / "checkpoints", None, required=True)
    with pytest.raises(jobs.ConfigError, match=r"the run will end with the checkpoints of steps \[\] only"):
        jobs.plan_merge(cfg, tmp_path / "out" / "checkpoints", elsewhere, required=True)


def test_a_config_file_with_an_unknown_missing_or_mistyped_key_is_refused(caplog, monkeypatch, tmp_path) -> None:
    def extra(config):
        config["model"]["depth"] = 3

    def missing(config):
        del config["eval"]

    def mistyped(config):
        config["checkpoint"] = 100

    cases = [(extra, "unknown config key 'model.depth'"), (missing, "config key 'eval' is missing"),
             (mistyped, "config key 'checkpoint' must be a mapping, got 100")]  # fmt: skip
    for change, message in cases:
        assert message in refused(caplog, monkeypatch, "--config", edited(tmp_path, change))


def test_resume_without_a_finished_checkpoint_is_refused(caplog, monkeypatch, tmp_path) -> None:
    (tmp_path / "checkpoints" / ".step-000000004.incomplete").mkdir(parents=True)  # never finished
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path), "--resume")
    assert message == f"config error: --resume: no finished checkpoint under {tmp_path / 'checkpoints'}"


def test_a_new_run_into_a_folder_with_finished_checkpoints_is_refused(caplog, monkeypatch, tmp_path) -> None:
    finished = tmp_path / "checkpoints" / "step-00000200"
    finished.mkdir(parents=True)
    (finished / "train.json").write_text('{"step": 200, "engine": "fsdp2"}')
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path))
    assert "holds checkpoints of an earlier run (newest step-00000200): --resume to continue it" in message
    assert finished.is_dir()


def test_an_average_named_posthoc_is_refused(caplog, monkeypatch, tmp_path) -> None:
    def named_posthoc(config):
        config["averages"]["posthoc"] = {"kind": "swa"}

    message = refused(caplog, monkeypatch, "--config", edited(tmp_path, named_posthoc))
    assert "config key 'averages.posthoc': names are lower-case words other than 'raw' and 'posthoc'" in message


def test_a_new_run_into_a_folder_with_post_hoc_snapshots_is_refused(caplog, monkeypatch, tmp_path) -> None:
    (tmp_path / "posthoc" / "snapshot-000000050").mkdir(parents=True)
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path))
    assert "holds post-hoc snapshots of an earlier run (snapshot-000000050): --resume to continue it" in message


def test_every_shipped_config_is_valid(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.name == "bench.yaml":
            continue
        job = train.load_job(train.parse_args(["--config", str(path)]), world=2)
        assert job.cfg["engine"] == path.stem and set(job.rules) == {"ema", "power"}
        assert (job.deepspeed_config is not None) == (path.stem == "zero3")
        assert job.cfg["checkpoint"]["async"] is False
        assert job.cfg["merge"]["last"] == (None if path.stem == "zero3" else 4)  # (steps 450 to 600)


def test_data_that_cannot_serve_is_refused_naming_it(caplog, monkeypatch, tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "tiny.txt").write_bytes(b"0123456789")
    os.mkfifo(tmp_path / "pipe")  # opening it for reading would block: the check must not
    cases = [
        (tmp_path / "empty", "holds no regular file to train on"),
        (tmp_path / "tiny.txt", "the train text has 9 bytes, fewer than one window of 128"),
        (tmp_path / "pipe", "is neither a regular file nor a folder (a pipe or a device?)"),
        (Path("/dev/zero"), "is neither a regular file nor a folder (a pipe or a device?)"),
    ]
    for path, why in cases:
        with deadline(30):
            message = refused(caplog, monkeypatch, "--config", FSDP2, "--data", str(path), "--out", str(tmp_path / "o"))
        assert message.startswith("config error: config key 'data.path'") and why in message, message
    assert not (tmp_path / "o").exists()


BOUNDED_READ = """
import resource, sys
from launch import train
job = train.load_job(train.parse_args(["--config", sys.argv[1], "--data", sys.argv[2], "--out", sys.argv[3],
                                       "--set", "data.max_bytes=100000"]), world=2)
print(len(job.corpus.train) + len(job.corpus.heldout), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_data_reads_at_most_max_bytes_of_a_huge_file(tmp_path) -> None:
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as handle:
        handle.truncate(3 * 2**30)  # sparse: 3 GiB that cost no disk
    done = subprocess.run(
        [sys.executable, "-c", BOUNDED_READ, FSDP2, str(huge), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,  # (python -c imports the package launch from here)
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    used, peak_kib = map(int, done.stdout.split())
    assert used <= 100_000 and peak_kib < 1.5 * 2**20, (used, peak_kib)  # before: 3.4 GB of peak memory


def test_an_out_that_is_a_file_or_holds_a_users_files_is_refused(caplog, monkeypatch, tmp_path) -> None:
    (tmp_path / "a-file").write_text("mine")
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path / "a-file"))
    assert "is a file, not a folder" in message and (tmp_path / "a-file").read_text() == "mine"
    users = tmp_path / "users"
    users.mkdir()
    for name in ("metrics.jsonl", "summary.json", "plot.png", "notes.txt"):
        (users / name).write_text("mine")
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(users))
    assert "holds metrics.jsonl, plot.png, summary.json, which this job writes, but no run.json" in message
    assert all((users / name).read_text() == "mine" for name in ("metrics.jsonl", "summary.json", "plot.png"))
    (users / "run.json").write_text('{"job": "something else"}')
    assert "run.json there was not written by this job" in refused(caplog, monkeypatch, "--config", FSDP2, "--out",
                                                                     str(users))  # fmt: skip


def test_weight_files_under_export_that_the_job_did_not_write_are_refused_before_training(
    caplog, monkeypatch, tmp_path
) -> None:
    out = tmp_path / "run"
    (out / "export" / "ema").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"job": "shardavg launch/train.py"}))  # a run of this job's
    (out / "metrics.jsonl").write_text('{"step": 10}\n')  # its own, from a run that stopped before a checkpoint
    save_file({"w": torch.zeros(2)}, str(out / "export" / "ema" / "model.safetensors"))  # the user's weights
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(out))
    assert "export/ema/model.safetensors is not a weight file this job exported" in message
    (out / "export" / "ema" / "model.safetensors").unlink()
    monkeypatch.setenv("WORLD_SIZE", "2")
    job = train.load_job(train.parse_args(["--config", FSDP2, "--out", str(out)]), world=2)
    assert job.out == out and job.resume_from is None  # the job's own folder: a new run may reuse it


def dcp_checkpoint(root: Path, step: int, engine: str = "fsdp2", hashed: bool = True) -> Path:
    """A finished checkpoint as the job writes one: a DCP folder, then train.json with every file's hash."""
    import torch.distributed.checkpoint as dcp

    folder = root / "checkpoints" / f"step-{step:08d}"  # (the eight digits of earlier runs: still read)
    state = {"model": {"w": torch.arange(6.0) * step}, "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    record = {"step": step, "engine": engine} | ({"files": checkpoints.digests(folder)} if hashed else {})
    (folder / "train.json").write_text(json.dumps(record))
    return folder


def flipped(data: bytes) -> bytes:
    return bytes([data[0] ^ 1]) + data[1:]


def test_resume_skips_a_damaged_newest_checkpoint_saying_why(caplog, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    older, newest = dcp_checkpoint(tmp_path, 4), dcp_checkpoint(tmp_path, 8)
    data_file = next(newest.glob("*.distcp"))
    damages = {
        "truncated .distcp": lambda: data_file.write_bytes(data_file.read_bytes()[:10]),
        "missing .distcp": lambda: data_file.unlink(),
        "garbage .metadata": lambda: (newest / ".metadata").write_bytes(b"\x80\x04garbage"),
        "a flipped byte": lambda: data_file.write_bytes(flipped(data_file.read_bytes())),
        "bad train.json": lambda: (newest / "train.json").write_text('{"step": 7, "engine": "fsdp2"}'),
        "other engine": lambda: (newest / "train.json").write_text('{"step": 8, "engine": "zero3"}'),
    }  # fmt: skip
    pristine = tmp_path / "pristine"
    shutil.copytree(newest, pristine)
    for label, damage in damages.items():
        damage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="train"):
            job = train.load_job(train.parse_args(["--config", FSDP2, "--out", str(tmp_path), "--resume"]), world=2)
        assert job.resume_from == older, label
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warning.startswith("--resume: skipped step-00000008, which cannot be resumed from: "), warning
        message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path), "--resume-from", str(newest))
        assert message.startswith(f"config error: --resume-from {newest}: "), (label, message)
        shutil.rmtree(newest)
        shutil.copytree(pristine, newest)
    shutil.rmtree(older)
    (newest / ".metadata").write_bytes(b"garbage")
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path), "--resume")
    assert "--resume: no checkpoint under" in message and "step-00000008: .metadata does not match" in message


EVIL = """
import os, pickle, sys
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
open(sys.argv[1], "wb").write(pickle.dumps(Evil()))
"""


def test_a_pickle_in_the_metadata_of_an_unhashed_checkpoint_is_refused_without_running(
    caplog, monkeypatch, tmp_path
) -> None:
    folder = dcp_checkpoint(tmp_path, 4, hashed=False)  # saved before hashes were recorded
    subprocess.run([sys.executable, "-c", EVIL, str(folder / ".metadata"), str(tmp_path / "pwned")], check=True)
    message = refused(caplog, monkeypatch, "--config", FSDP2, "--out", str(tmp_path), "--resume")
    assert "asks to load posix.system, which a checkpoint has no business with: refused" in message, message
    assert not (tmp_path / "pwned").exists()
