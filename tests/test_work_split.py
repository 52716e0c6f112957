"""One work-splitting toolkit for the export and the merge: the same pieces for the same tensors,
one row planner, one agreement step, one digest."""

from __future__ import annotations

import pytest
import torch

from shardavg.averager.export import work_of
from shardavg.base.dist import digest
from shardavg.checkpoints.storage import Entry
from shardavg.offline.merge import Planned, _work
from shardavg.offline.sources import Spec
from shardavg.output.record import FolderRecord
from shardavg.output.weight_files import WeightPlan
from shardavg.output.work import Work, Writers, assign, pieces

SHAPES = {"embed": (10, 4), "scale": (3,), "proj": (7, 2), "step": ()}  # fp32: 160, 12, 56 and 4 bytes


def test_the_row_planner_cuts_a_large_tensor_into_consecutive_rows() -> None:
    assert pieces(0, (10, 4), 160, (0,), 50) == [  # 16 bytes a row: 3 rows a piece
        Work(0, (0, 3), 48, (0,)), Work(0, (3, 6), 48, (0,)), Work(0, (6, 9), 48, (0,)), Work(0, (9, 10), 16, (0,)),
    ]  # fmt: skip
    assert pieces(1, (10, 4), 320, (1, 2), 20) == [Work(1, (k, k + 1), 32, (1, 2)) for k in range(10)]  # a row at least
    assert pieces(2, (10, 4), 160, (3,), 160) == [Work(2, None, 160, (3,))]
    assert pieces(3, (1, 400), 1600, (4,), 8) == [Work(3, None, 1600, (4,))]  # one row: whole
    assert pieces(4, (), 4, (5,), 1) == [Work(4, None, 4, (5,))]


def test_export_and_merge_plan_the_same_pieces_for_the_same_tensors() -> None:
    entries = [Entry(name, torch.float32, shape) for name, shape in SHAPES.items()]
    record = FolderRecord("export")
    for writers in (1, 2, 3, 5):
        largest = -(-sum(entry.nbytes for entry in entries) // writers)  # the merge's: 1/writers of the whole
        exported = work_of(list(range(len(entries))), WeightPlan(entries, 2**30, record), largest)
        plan = [Planned((name,), (name,)) for name in SHAPES]
        merged = _work(plan, [Spec(torch.float32, shape) for shape in SHAPES.values()], "safetensors", writers)
        assert exported == merged, writers
    embed, proj = [(0, (k, k + 2)) for k in range(0, 10, 2)], [(2, (0, 5)), (2, (5, 7))]  # 47 bytes a piece at most
    assert [(w.index, w.rows) for w in merged] == [*embed, (1, None), *proj, (3, None)]  # (232 bytes, 5 writers)


def test_a_tied_tensor_is_one_piece_written_under_each_name() -> None:
    entries = [Entry("embed", torch.float32, (10, 4)), Entry("head", torch.float32, (10, 4))]
    exported = work_of([0, 0], WeightPlan(entries, 2**30, FolderRecord("export")), 160)
    merged = _work([Planned(("embed", "head"), ("embed",))], [Spec(torch.float32, (10, 4))], "safetensors", 2)
    assert exported == merged == [Work(0, (0, 5), 160, (0, 1)), Work(0, (5, 10), 160, (0, 1))]


def test_work_goes_to_the_writers_in_runs_of_about_the_same_bytes() -> None:
    assert assign([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert assign([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert assign([0, 0], 3) == [0, 0]


def test_one_digest_for_every_agreement() -> None:
    value = [["w", (2, 3), "float32"], [0.25, 0.75], "/out"]
    assert digest(value) == digest([["w", (2, 3), "float32"], [0.25, 0.75], "/out"])
    assert len(digest(value)) == 4 and all(0 <= part < 2**56 for part in digest(value))
    assert digest(value) != digest([["w", (3, 2), "float32"], [0.25, 0.75], "/out"])


def test_a_writer_alone_raises_its_own_error_as_it_is() -> None:
    alone = Writers.of(True)  # no process group: alone, whatever is asked
    assert (alone.rank, alone.count, alone.together, alone.lead) == (0, 1, False, True)
    alone.agree(None, "writing")
    refused = ValueError("w: 1 values overflow float16")
    with pytest.raises(ValueError) as raised:
        alone.agree(refused, "writing")
    assert raised.value is refused and alone.same([1, 2])
