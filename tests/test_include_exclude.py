"""``include=`` / ``exclude=``: which tensors are averaged, chosen by name (ema-pytorch's
``param_or_buffer_names_no_ema``). A tensor the patterns leave out is copied at each update, so
an export is still a whole model; a pattern that matches nothing is refused when the averager is
built; checkpoints record the patterns and refuse to load into an averager with others.

TiedNet's tensors: ``embed.weight`` (tied to ``head.weight``), ``block.{up,down}.{weight,bias}``,
``block.norm.*`` (BatchNorm), ``gain``, and the frozen ``frozen.proj.{weight,bias}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import TiedNet
from helpers import assert_same_average, fresh, trained
from safetensors.torch import load_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardavg import EMA, CheckpointError, WeightAverager
from shardavg.checkpoints.description import with_checksum
from shardavg.checkpoints.format import MANIFEST

# The blocks and the embedding averaged, but for the block's first layer: include, then exclude.
PATTERNS = {"include": ["block.*", "embed.weight"], "exclude": ["block.up.*"]}
AVERAGED = {
    "embed.weight", "head.weight", "block.norm.weight", "block.norm.bias", "block.down.weight", "block.down.bias",
}  # fmt: skip
LEFT_OUT = {"block.up.weight", "block.up.bias", "gain"}  # trained parameters the patterns leave out: copied


def test_included_tensors_match_averaged_model_and_left_out_ones_the_live_weights(model, trainer) -> None:
    averager = WeightAverager(model, EMA(decay=0.9), **PATTERNS)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # every parameter: read the included
    for _ in range(12):
        trainer.step()
        averager.update()
        reference.update_parameters(model)
    at_last_update = {name: value.detach().clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        model.gain.add_(1.0)  # after the last update: a copied tensor keeps what that update saw
        model.block.up.bias.add_(1.0)

    got, averaged = averager.full_state_dict(), reference.module.state_dict()
    assert set(got) == set(at_last_update)
    for name in AVERAGED:
        assert torch.equal(got[name], averaged[name]), name
    for name in set(got) - AVERAGED:  # left out, frozen (live) and buffers (copied)
        assert torch.equal(got[name], at_last_update[name]), name
    assert not torch.equal(got["gain"], averaged["gain"])  # (so the comparison above says something)

    roles = {entry.name: entry.role for entry in averager._state.describe().tensors}
    assert {name for name, role in roles.items() if role == "average"} == AVERAGED - {"head.weight"}
    assert {name for name in LEFT_OUT if roles[name] == "copy"} == LEFT_OUT
    with averager.swapped():
        assert torch.equal(model.gain, at_last_update["gain"])  # the copy, not the value written since
    assert torch.equal(model.gain, at_last_update["gain"] + 1.0)


def test_an_export_is_a_whole_model(model, trainer, tmp_path: Path) -> None:
    averager = trained(trainer, steps=3, exclude="block.*")  # (a string is one pattern)
    assert averager.options.exclude == ("block.*",)
    out = averager.export(tmp_path / "out")
    exported = load_file(str(out / "model.safetensors"))
    TiedNet().load_state_dict(exported, strict=True)
    got = averager.full_state_dict()
    assert all(torch.equal(exported[name], got[name]) for name in got)
    assert torch.equal(exported["block.up.weight"], model.block.up.weight)


def test_patterns_are_globs_kept_sorted_and_narrow_only(model) -> None:
    averager = WeightAverager(model, EMA(decay=0.9), include={"gain", "frozen.*", "block.?p.weight"})
    assert averager.options.include == ("block.?p.weight", "frozen.*", "gain")  # (a set's order: any)
    roles = {entry.name: entry.role for entry in averager._state.describe().tensors}
    assert {name for name, role in roles.items() if role == "average"} == {"block.up.weight", "gain"}
    assert roles["frozen.proj.weight"] == "live"  # frozen: include_frozen=True would average it
    assert roles["block.norm.running_mean"] == "copy"  # a buffer: copied, as buffers="copy" says
    tied = WeightAverager(model, EMA(decay=0.9), exclude=["head.*"])  # a tied tensor matches by any name
    assert "embed.weight" not in {e.name for e in tied._state.describe().tensors if e.role == "average"}


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"exclude": ["block.upp.*"]}, "exclude pattern(s) ['block.upp.*'] match no tensor of the model"),
        ({"include": ["module.block.*", "gain"]}, "include pattern(s) ['module.block.*'] match no tensor"),
        ({"include": "Gain"}, "include pattern(s) ['Gain'] match no tensor"),  # (case-sensitive everywhere)
    ],
)
def test_a_pattern_that_matches_no_tensor_is_refused_naming_it(model, patterns, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        WeightAverager(model, EMA(decay=0.9), **patterns)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert "names (such as 'block.up.weight')" in str(refused.value)  # (a deepest name: the structure shows)
    assert str(refused.value).endswith("correct or remove them")


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"include": []}, r"^include=\[\] would average no tensor: pass None"),
        ({"exclude": ["gain", 3]}, r"^exclude must be a glob pattern or a list of them .*got \['gain', 3\]"),
        ({"exclude": [""]}, r"^exclude must be a glob pattern"),
        ({"include": {"gain": 1}}, r"^include must be a glob pattern"),
    ],
)
def test_a_malformed_pattern_is_refused_naming_the_option(model, patterns, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightAverager(model, EMA(decay=0.9), **patterns)


def rewritten(path: Path, change) -> None:
    """The checkpoint's manifest with its options changed by ``change``, checksummed again (crafted)."""
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest["options"])
    (path / MANIFEST).write_text(json.dumps(with_checksum({k: v for k, v in manifest.items() if k != "checksum"})))


def test_checkpoints_record_the_patterns_and_resume_under_them(trainer, tmp_path: Path) -> None:
    averager = trained(trainer, **PATTERNS)
    path = averager.save(tmp_path / "ckpt")
    recorded = json.loads((path / MANIFEST).read_text())["options"]
    assert recorded["include"] == ["block.*", "embed.weight"] and recorded["exclude"] == ["block.up.*"]
    restored = fresh(**PATTERNS)
    restored.load(path)
    assert restored.num_updates == averager.num_updates
    assert_same_average(restored, averager)


def test_a_checkpoint_saved_under_other_patterns_is_refused_naming_both(trainer, tmp_path: Path) -> None:
    path = trained(trainer, **PATTERNS).save(tmp_path / "ckpt")
    averager = fresh(exclude=["block.up.*"])
    with pytest.raises(CheckpointError) as refused:
        averager.load(path)
    assert str(refused.value).endswith(
        "was saved with other patterns: include=['block.*', 'embed.weight'] in the checkpoint, "
        "include=None here; build the averager with the checkpoint's, or pass strict=False to load it"
    )
    assert "\n" not in str(refused.value)
    assert averager.num_updates == 0  # nothing was loaded
    with pytest.warns(UserWarning, match=r"include=\['block.\*', 'embed.weight'\] in the checkpoint"):
        averager.load(path, strict=False)
    assert averager.num_updates == 5
    with pytest.raises(CheckpointError, match=r"exclude=\['block.up.\*'\] in the checkpoint, exclude=\[\] here"):
        fresh(include=["block.*", "embed.weight"]).load(path)


def test_the_state_dict_refuses_other_patterns_too(trainer) -> None:
    state = trained(trainer, exclude="gain").state_dict()
    with pytest.raises(CheckpointError, match=r"exclude=\['gain'\] in the checkpoint, exclude=\[\] here"):
        fresh().load_state_dict(state)
    fresh(exclude="gain").load_state_dict(state)


def test_a_checkpoint_from_before_the_patterns_has_none(trainer, tmp_path: Path) -> None:
    path = trained(trainer).save(tmp_path / "ckpt")
    rewritten(path, lambda options: [options.pop("include", None), options.pop("exclude", None)])
    fresh().load(path)
    with pytest.raises(CheckpointError, match=r"exclude=\[\] in the checkpoint, exclude=\['gain'\] here"):
        fresh(exclude="gain").load(path)


def test_an_average_saved_without_patterns_records_what_0_12_records() -> None:
    """A reader from before the patterns refuses an option it does not know: they are written only
    where set, so every other checkpoint stays readable there."""
    from shardavg.update.options import Options

    assert list(Options().to_json()) == ["every_n_steps", "start_step", "dtype", "buffers", "include_frozen"]
    assert Options(include=["a*"]).to_json()["include"] == ["a*"] and "exclude" not in Options(include="a*").to_json()
