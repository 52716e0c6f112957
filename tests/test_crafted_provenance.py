"""Crafted provenance records, in a model folder's ``provenance.json`` or in a manifest: read
bounded and typed (``provenance.load`` / ``read``), refused in one line naming the file, never a
``TypeError``, ``KeyError``, ``AttributeError`` or ``RecursionError``. ``shardavg inspect`` prints
what it can read and one error line per file it cannot, with exit code 2; an export over a folder
holding one refuses before writing anything."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers import trained

from shardavg import CheckpointError
from shardavg.base.errors import ProvenanceError
from shardavg.checkpoints.description import with_checksum
from shardavg.checkpoints.format import PROVENANCE_DEPTH
from shardavg.cli import main as cli_main
from shardavg.output.provenance import load, of_input, read

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


def merges(levels: int) -> dict:
    """A valid record of ``levels`` merges of merges (``3 * levels + 1`` arrays and objects deep)."""
    record: dict = {"made": "export", "shardavg": "0.7.1", "step": 3}
    for level in range(levels):
        record = {"made": "merge", "shardavg": "0.7.1", "inputs": [{"path": f"m{level}", "weight": 1.0,
                                                                  "provenance": record}]}  # fmt: skip
    return record


def crafted_records(good: dict) -> dict[str, tuple[str, str]]:
    """``{case: (provenance.json's text, the message that refuses it)}``."""
    return {
        "nested": ('{"made": "merge", "shardavg": "0.7", "x": ' + DEEP + "}", r"nested more than 100 levels deep"),
        "nested-under-the-limit-of-json": (
            json.dumps(good | {"extra": json.loads("[" * 900 + "]" * 900)}),
            r"nested more than 100 levels deep \(PROVENANCE_DEPTH\)",
        ),
        "no-weight": (
            json.dumps(good | {"inputs": [{"path": "a"}]}),
            r"inputs\[0\]: a provenance input needs \['weight'\]",
        ),
        "no-path": (
            json.dumps(good | {"inputs": [{"weight": 1}]}),
            r"inputs\[0\]: a provenance input needs \['path'\]",
        ),
        "inputs-text": (json.dumps(good | {"inputs": "abc"}), r"'inputs' must be list, got str abc"),
        "command-number": (json.dumps(good | {"command": 5}), r"'command' must be list, got int 5"),
        "command-numbers": (json.dumps(good | {"command": [5]}), r"'command' must be a list of strings"),
        "weight-text": (
            json.dumps(good | {"inputs": [{"path": "a", "weight": "1"}]}),
            r"'weight' must be int or float, got str 1",
        ),
        "nested-input": (
            json.dumps(good | {"inputs": [{"path": "a", "weight": 1, "provenance": {"made": 3, "shardavg": "x"}}]}),
            r"inputs\[0\]\.provenance: 'made' must be str, got int 3",
        ),
        "not-an-object": ("[1, 2]", r"a provenance record must be an object, got list"),
        "foreign": ('{"notes": "mine"}', r"a provenance record needs \['made', 'shardavg'\], has \['notes'\]"),
        "not-json": ("{nope", r"is not JSON"),
        "merges-too-deep": (json.dumps(merges(34)), r"nested more than 100 levels deep"),
    }


@pytest.fixture
def exported(trainer, tmp_path) -> Path:
    path = tmp_path / "model"
    trained(trainer, steps=2).export(path)
    return path


def test_inspect_shows_what_it_can_and_one_line_per_bad_record(exported, tmp_path, capsys) -> None:
    good = json.loads((exported / "provenance.json").read_text())
    assert cli_main(["inspect", str(exported)]) == 0
    assert "made export" in capsys.readouterr().out
    for label, (text, match) in crafted_records(good).items():
        (exported / "provenance.json").write_text(text)
        with pytest.raises(ProvenanceError, match=match):
            read(exported)
        assert cli_main(["inspect", str(exported)]) == 2, label
        out, err = capsys.readouterr()
        assert out.startswith(f"model        {exported}\nfiles        1 weight file(s), "), (label, out)
        assert "provenance   unreadable (the error below)" in out, (label, out)
        assert err.startswith(f"shardavg: error: {exported / 'provenance.json'}") and err.count("\n") == 1, (label, err)
        assert re.search(match, err), (label, err)


def test_a_record_too_large_or_not_a_file_is_refused_before_it_is_read(exported, capsys) -> None:
    path = exported / "provenance.json"
    path.unlink()
    with open(path, "wb") as handle:
        handle.truncate(2**30)  # sparse: no room on disk, 1 GiB to anyone who reads it whole
    with pytest.raises(ProvenanceError, match=rf"^{path} is 1073741824 bytes, more than a provenance record may "
                                              r"hold \(PROVENANCE_LIMIT, 16 MiB\)$"):  # fmt: skip
        read(exported)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ProvenanceError, match=rf"^cannot read {path}: {path} is not a regular file: refused$"):
        load(path)
    assert cli_main(["inspect", str(exported)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_an_export_over_a_crafted_record_refuses_before_writing(trainer, exported) -> None:
    (exported / "provenance.json").write_text('{"made": "export", "shardavg": "0.7", "x": ' + DEEP + "}")
    weights = (exported / "model.safetensors").read_bytes()
    averager = trained(trainer, steps=1)
    with pytest.raises(
        CheckpointError,
        match=rf"^{exported / 'provenance.json'} was not written by shardavg \(nested "
        r"more than 100 levels deep \(PROVENANCE_DEPTH\)\): it would be replaced",
    ):
        averager.export(exported)
    assert (exported / "model.safetensors").read_bytes() == weights


def test_a_manifests_crafted_record_is_refused_in_one_line(trainer, tmp_path, capsys) -> None:
    """In a manifest (``merge --format shardavg`` writes one there) the record is part of the
    description, checked whole with it: inspect, export and load refuse in one line."""
    averager = trained(trainer, steps=2)
    cases = {
        "no-weight": ({"made": "merge", "shardavg": "0.7", "inputs": [{"path": "a"}]}, r"needs \['weight'\]"),
        "deep": ({"made": "merge", "shardavg": "0.7", "x": json.loads("[" * 900 + "]" * 900)}, "nested more than 100"),
        "command": ({"made": "merge", "shardavg": "0.7", "command": 5}, "'command' must be list"),
    }
    for label, (record, match) in cases.items():
        path = averager.save(tmp_path / label)
        meta = json.loads((path / "shardavg.json").read_text())
        meta.pop("checksum")
        (path / "shardavg.json").write_text(json.dumps(with_checksum(meta | {"provenance": record})))
        with pytest.raises(ProvenanceError, match=rf"{path / 'shardavg.json'}: 'provenance'.*{match}"):
            read(path)
        for args in (["inspect", str(path)], ["export", str(path), str(tmp_path / f"{label}-out")]):
            assert cli_main(args) == 2, (label, args)
            err = capsys.readouterr().err
            assert err.startswith("shardavg: error:") and err.count("\n") == 1 and re.search(match, err), (label, err)
        assert not (tmp_path / f"{label}-out").exists()


def test_merges_of_merges_nest_up_to_the_limit_and_no_further(tmp_path) -> None:
    """A record nested to the limit is read; an input holding one is recorded without it (nesting
    it once more would pass the limit); one past the limit is refused."""
    folder = tmp_path / "input"
    folder.mkdir()
    levels = (PROVENANCE_DEPTH - 1) // 3  # 33 merges: 100 levels deep
    (folder / "provenance.json").write_text(json.dumps(merges(levels)))
    assert read(folder) == merges(levels)
    assert "provenance" not in of_input(folder, 3, 0.5)
    (folder / "provenance.json").write_text(json.dumps(merges(levels - 1)))
    assert of_input(folder, 3, 0.5)["provenance"] == merges(levels - 1)
    (folder / "provenance.json").write_text(json.dumps(merges(levels + 1)))
    with pytest.raises(ProvenanceError, match="nested more than 100 levels deep"):
        of_input(folder, 3, 0.5)
