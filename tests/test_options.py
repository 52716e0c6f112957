"""An option is declared in one place, ``Options``: ``WeightAverager`` takes it by keyword, a
description records it (``to_json``) and reads it back checked (``from_json``), and a field added
to ``Options`` alone travels through ``avg.save``/``avg.load``, DCP and the export's metadata.
Rules serialise themselves the same way (``Rule.to_json``/``Rule.from_json``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import make_dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import fresh, trained
from safetensors import safe_open

from shardavg import EMA, SWA, CheckpointError, PowerEMA, Rule, WeightAverager
from shardavg.checkpoints.description import with_checksum
from shardavg.checkpoints.format import MANIFEST, check_description, decode_description, parse_manifest
from shardavg.update.options import Options, option

# The options dict every checkpoint since format version 2 holds, key for key (avg.save, DCP).
RECORDED_SINCE_V2 = {
    "every_n_steps": 1,
    "start_step": 0,
    "dtype": "float32",
    "buffers": "copy",
    "include_frozen": False,
}
# ... and those recorded now at their defaults: the options added later (include, exclude) are
# written only where set, so that a reader from before them can read the rest.
RECORDED = RECORDED_SINCE_V2


def below_100(name: str, value: object) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 100):
        raise ValueError(f"{name} must be an int in [0, 100), got {value!r}")
    return value


@pytest.fixture
def dummy_option(monkeypatch) -> None:
    """``Options`` with one more recorded field, ``dummy`` (default 7), added here and nowhere else:
    the class itself takes the extended fields, so every module that holds it sees the new one."""
    extended = make_dataclass(
        "Options", [("dummy", int, option(7, below_100, recorded=True))], bases=(Options,), frozen=True, kw_only=True
    )
    for name in ("__dataclass_fields__", "__init__", "__repr__", "__eq__", "__hash__"):
        monkeypatch.setattr(Options, name, getattr(extended, name))


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one process, so that DCP runs its distributed path."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def rewritten(path: Path, change) -> None:
    """The checkpoint's manifest with its options changed by ``change``, checksummed again (crafted)."""
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest["options"])
    (path / MANIFEST).write_text(json.dumps(with_checksum({k: v for k, v in manifest.items() if k != "checksum"})))


# ----------------------------------------------------------------------------- declared once


def test_the_averager_takes_every_option_by_keyword_and_refuses_an_unknown_one(trainer) -> None:
    given = {"every_n_steps": 2, "start_step": 1, "dtype": None, "buffers": "average", "include_frozen": True}
    averager = WeightAverager(trainer.model, EMA(decay=0.9), device="cpu", on_nonfinite="skip", **given)
    assert averager.options == Options(device=torch.device("cpu"), on_nonfinite="skip", **given)
    with pytest.raises(TypeError) as refused:
        WeightAverager(trainer.model, EMA(decay=0.9), every_n_step=2)
    assert str(refused.value) == (
        "WeightAverager got unknown keyword argument(s) ['every_n_step']: it takes avg_fn, strategy, source, pipeline, "
        "every_n_steps, start_step, dtype, buffers, device, include_frozen, include, exclude, on_nonfinite, "
        "screen_every, background "
        "(the options are documented in shardavg.update.options.Options)"
    )
    with pytest.raises(TypeError):
        Options(2)  # type: ignore[misc]  (keywords only: no positional call to keep in order)
    with pytest.raises(ValueError, match="include_frozen must be True or False, got 1"):
        Options(include_frozen=1)


ABSENT_DEVICES = ["nonsense", 123, True, "meta", "cuda:4096", *([] if torch.cuda.is_available() else ["cuda"])]


@pytest.mark.parametrize("device", ABSENT_DEVICES)
def test_a_device_this_machine_lacks_is_refused_in_one_line_naming_it(trainer, device) -> None:
    """torch takes "meta" (the averager then fails at its first export) and "cuda" on a CPU machine
    (failing at the first shadow), and refuses 123 in its own words: each is refused on entry."""
    with pytest.raises(ValueError, match=r"^device=.* is not a device of this machine: use None .*'cpu'") as refused:
        WeightAverager(trainer.model, EMA(decay=0.9), device=device)
    assert repr(device) in str(refused.value) and "\n" not in str(refused.value)
    assert WeightAverager(trainer.model, EMA(decay=0.9), device="cpu:0").options.device == torch.device("cpu", 0)


def test_the_integrations_refuse_a_bad_option_when_built() -> None:
    from shardavg.integrations.lightning import ShardedWeightAveraging

    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['bufers'\]"):
        ShardedWeightAveraging(decay=0.9, bufers="copy")
    with pytest.raises(ValueError, match="unknown on_nonfinite policy 'warn'"):
        ShardedWeightAveraging(decay=0.9, on_nonfinite="warn")
    assert ShardedWeightAveraging(decay=0.9, strategy="auto", dtype=None).averager_options == {
        "strategy": "auto", "dtype": None,
    }  # fmt: skip


# ----------------------------------------------------------------------------- serialised by Options


def test_the_recorded_options_are_those_every_checkpoint_holds(trainer) -> None:
    assert Options().to_json() == RECORDED
    assert list(Options().to_json()) == list(RECORDED)  # (the same order: the same bytes on disk)
    described = trained(trainer, steps=1, dtype=torch.float64, buffers="ignore", on_nonfinite="off")._state.describe()
    written = described.to_json()["options"]
    assert written == RECORDED | {"dtype": "float64", "buffers": "ignore"}
    parsed = check_description(json.loads(json.dumps(described.to_json())), "test").options
    assert isinstance(parsed, Options) and parsed.to_json() == written
    assert parsed == Options(dtype=torch.float64, buffers="ignore")  # (on_nonfinite is not recorded)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            [1],
            "'options' must hold ['buffers', 'dtype', 'every_n_steps', 'include_frozen', 'start_step'] "
            "(and may hold ['exclude', 'include']), got [1]",
        ),
        (RECORDED_SINCE_V2 | {"device": "cpu"}, "'options' must hold ['buffers', 'dtype', 'every_n_steps', "),
        ({k: v for k, v in RECORDED_SINCE_V2.items() if k != "dtype"}, "'options' must hold ['buffers', 'dtype', "),
        (
            RECORDED_SINCE_V2 | {"every_n_steps": True, "dtype": "int64", "buffers": "all", "include_frozen": 1},
            "'options' has invalid values: every_n_steps=True, dtype='int64', buffers='all', include_frozen=1",
        ),
        (
            RECORDED_SINCE_V2 | {"start_step": -1, "dtype": ["float32"]},
            "'options' has invalid values: start_step=-1, dtype=['float32']",
        ),
    ],
)
def test_crafted_options_are_refused_in_one_line_naming_where(trainer, options, message: str) -> None:
    raw = trained(trainer, steps=1)._state.describe().to_json() | {"options": options}
    with pytest.raises(CheckpointError) as refused:
        check_description(with_checksum({k: v for k, v in raw.items() if k != "checksum"}), "crafted.json")
    assert str(refused.value).startswith(f"crafted.json: {message}") and "\n" not in str(refused.value)


def test_rules_serialise_themselves() -> None:
    for rule in (EMA(decay=0.9), EMA(half_life=100), SWA(), PowerEMA(sigma_rel=0.1)):
        assert rule.to_json() == rule.to_config() and Rule.from_json(rule.to_json(), "here") == rule
    assert Rule.from_json({"kind": "custom", "name": "train.my_ema"}, "here") is None
    crafted = {
        "{'kind': 'ema', 'decay': 0.9}": {"kind": "ema", "decay": 0.9},  # (its warmup left out: not to_config's)
        "{'kind': 'ema', 'decay': 2.0, 'warmup': None} is not a rule: ValueError(": {
            "kind": "ema", "decay": 2.0, "warmup": None,
        },
        "is not a custom rule's config": {"kind": "custom", "name": 3},
    }  # fmt: skip
    for fragment, data in crafted.items():
        with pytest.raises(CheckpointError, match="^ckpt: 'rule' ") as refused:
            Rule.from_json(data, "ckpt")
        assert fragment in str(refused.value)


# ----------------------------------------------------------------------------- a field added in one place


def test_an_added_option_round_trips_through_save_and_load(trainer, tmp_path, dummy_option) -> None:
    averager = trained(trainer, steps=2, dummy=3)
    assert averager.options.dummy == 3 and Options().dummy == 7
    with pytest.raises(ValueError, match=r"dummy must be an int in \[0, 100\), got 100"):
        WeightAverager(trainer.model, EMA(decay=0.9), dummy=100)
    path = averager.save(tmp_path / "ckpt")
    assert json.loads((path / MANIFEST).read_text())["options"] == RECORDED | {"dummy": 3}
    assert parse_manifest((path / MANIFEST).read_bytes(), str(path)).options.dummy == 3
    restored = fresh(dummy=3)
    restored.load(path)
    assert restored.num_updates == 2

    rewritten(path, lambda options: options.update(dummy=-1))
    with pytest.raises(CheckpointError, match="'options' has invalid values: dummy=-1$"):
        restored.load(path)
    rewritten(path, lambda options: options.pop("dummy"))  # a checkpoint written before it existed
    restored.load(path)
    assert parse_manifest((path / MANIFEST).read_bytes(), str(path)).options.dummy == 7


def test_an_added_option_round_trips_through_dcp(trainer, tmp_path, dummy_option, world_of_one) -> None:
    averager = trained(trainer, steps=2, dummy=5)
    dcp.save({"ema": averager}, checkpoint_id=str(tmp_path / "dcp"))
    state = {"ema": fresh(dummy=0).state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    assert decode_description(state["ema"]["meta"], "dcp").options.dummy == 5
    restored = fresh()
    dcp.load({"ema": restored}, checkpoint_id=str(tmp_path / "dcp"))
    assert restored.num_updates == 2


def test_an_added_option_round_trips_through_the_export_metadata(trainer, tmp_path, dummy_option) -> None:
    out = trained(trainer, steps=2, dummy=4).export(tmp_path / "out")
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        recorded = json.loads(handle.metadata()["shardavg"])
    assert recorded["options"] == RECORDED | {"dummy": 4}
    assert Options.from_json(recorded["options"], str(out)).dummy == 4
