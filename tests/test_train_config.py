"""The main job refuses a config that cannot run before it starts anything, with one message naming the key."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import train  # noqa: E402

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
        (["--config", FSDP2, "--set", "posthoc.sweep=[0.05, 0.5]"], "'posthoc.sweep' must list sigma_rel values"),
        (["--config", FSDP2, "--set", "posthoc.snapshot_every=-1"], "'posthoc.snapshot_every' must be 0 (off)"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(caplog, monkeypatch, argv, message) -> None:
    assert message in refused(caplog, monkeypatch, *argv)


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
    (tmp_path / "checkpoints" / ".step-00000004.partial").mkdir(parents=True)  # never finished
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
