"""One rank's failure is every rank's: ``agree_or_raise`` and ``gather_or_raise`` raise on every rank
with each failing rank's exception kept in ``failures`` (as plain data) besides the message.

In one process the world is one rank; other ranks' reports are played by replacing the gather
that carries them (what a real one delivers: tests_distributed/scenario_export_disks.py)."""

from __future__ import annotations

import pickle

import pytest

from shardavg import CheckpointError, ExportError
from shardavg.base import dist
from shardavg.base.errors import RankFailure


def test_a_failure_in_a_world_of_one_is_kept_by_rank() -> None:
    cause = OSError("disk full")
    with pytest.raises(CheckpointError) as raised:
        dist.agree_or_raise(cause, "writing shards to /ckpt.incomplete")
    assert str(raised.value) == "writing shards to /ckpt.incomplete failed: rank 0: OSError: disk full"
    assert raised.value.failures == {0: RankFailure("OSError", "disk full")}
    assert raised.value.__cause__ is cause
    dist.agree_or_raise(None, "nothing failed")  # no failure, no error


def test_every_rank_learns_each_failing_ranks_type_and_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 of four, which did not fail, raises with ranks 1's and 3's failures."""
    reports = [
        None,
        ("ExportError", "/out/.model.safetensors.incomplete is not this export's file"),
        None,
        ("PermissionError", "[Errno 13] /out"),
    ]
    monkeypatch.setattr(dist, "same_everywhere", lambda values: False)
    monkeypatch.setattr(dist, "all_gathered", lambda value: [(report, None) for report in reports])
    with pytest.raises(ExportError) as raised:
        dist.agree_or_raise(None, "exporting to /out", ExportError)
    assert raised.value.failures == {
        1: RankFailure("ExportError", "/out/.model.safetensors.incomplete is not this export's file"),
        3: RankFailure("PermissionError", "[Errno 13] /out"),
    }
    assert str(raised.value) == (
        "exporting to /out failed: rank 1: ExportError: /out/.model.safetensors.incomplete is not this export's "
        "file; rank 3: PermissionError: [Errno 13] /out"
    )
    assert raised.value.__cause__ is None  # this rank had no exception of its own


def test_gather_or_raise_keeps_the_failures_and_gives_the_values_when_none_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert dist.gather_or_raise(None, 7, "gathering") == [7]
    monkeypatch.setattr(dist, "all_gathered", lambda value: [(None, 5), (("ValueError", "bad tag"), None)])
    with pytest.raises(CheckpointError, match=r"^loading /ckpt failed: rank 1: ValueError: bad tag$") as raised:
        dist.gather_or_raise(None, 5, "loading /ckpt")
    assert raised.value.failures == {1: RankFailure("ValueError", "bad tag")}


def test_an_error_of_one_process_has_no_failures_and_the_failures_survive_pickling() -> None:
    """An error pickled (a process pool sending it back, say) keeps its ``failures``."""
    assert CheckpointError("not ours").failures == {}
    error = ExportError("exporting failed: rank 1: OSError: gone", failures={1: RankFailure("OSError", "gone")})
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ExportError and again.args == error.args and again.failures == error.failures
    assert str(RankFailure("OSError", "gone")) == "OSError: gone"
