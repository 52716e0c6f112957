"""Shard layouts: the parts the ranks own must tile every tensor, replicas are owned by the lowest
rank; parts of every shape (flat ranges, rows, columns, strided index ranges) are placed and taken
exactly."""

from __future__ import annotations

import pytest
import torch

from shardavg import LayoutError
from shardavg.layouts.parts import Part, place, tiles
from shardavg.layouts.shard_layout import tiling
from shardavg.layouts.tensor_info import TensorInfo


def info(name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, (), "param", torch.Size(shape), torch.float32, True, Part.whole(shape))


def flat(shape, *ranges) -> list[Part]:
    return [Part.flat(shape, start, end) for start, end in ranges]


def test_shards_tile_a_tensor_and_empty_ranks_own_nothing() -> None:
    parts = flat((10,), (0, 4), (4, 8), (8, 10), (10, 10))
    assert tiling(info("w", (10,)), parts) == ((0, parts[0]), (1, parts[1]), (2, parts[2]))


def test_replicas_are_owned_by_the_lowest_rank() -> None:
    assert tiling(info("w", (6,)), flat((6,), (0, 6), (0, 6), (0, 6))) == ((0, Part.whole((6,))),)
    hsdp = flat((6,), (0, 3), (3, 6), (0, 3), (3, 6))
    assert [owner for owner, _ in tiling(info("w", (6,)), hsdp)] == [0, 1]
    rows = [Part.grid((4, 6), [range(0, 2), range(6)]), Part.grid((4, 6), [range(2, 4), range(6)])]
    tp = [rows[0], rows[0], rows[1], rows[1]]  # sharded over dp, replicated over tp
    assert [owner for owner, _ in tiling(info("w", (4, 6)), tp)] == [0, 2]


@pytest.mark.parametrize(
    "ranges",
    [
        [(0, 4), (5, 10)],  # a gap
        [(0, 6), (4, 10)],  # an overlap
        [(0, 4), (4, 8)],  # short of the end
        [(0, 10), (0, 5), (5, 10)],  # two tilings at once
    ],
)
def test_shards_that_do_not_tile_are_named(ranges) -> None:
    with pytest.raises(
        LayoutError, match=r"the shards of 'block.up.weight' \(shape \(10,\)\) do not tile it: rank 0 holds \[0,"
    ):
        tiling(info("block.up.weight", (10,)), flat((10,), *ranges))


def test_column_and_row_shards_tile_and_their_overlaps_are_named() -> None:
    shape = (4, 6)
    columns = [Part.grid(shape, [range(4), range(0, 3)]), Part.grid(shape, [range(4), range(3, 6)])]
    assert len(tiling(info("w", shape), columns)) == 2
    mixed = [columns[0], Part.grid(shape, [range(2, 4), range(6)])]  # overlaps in rows 2-3, columns 0-2
    with pytest.raises(LayoutError, match=r"rank 0 holds boxes \[0, 0\]\+\[4, 3\], rank 1 holds \[12, 24\)"):
        tiling(info("w", shape), mixed)


def test_a_flat_range_is_at_most_2n_minus_1_boxes_and_reads_back() -> None:
    for shape in [(7,), (4, 6), (3, 4, 5), (), (2, 0, 3)]:
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        n = full.numel()
        for start in range(n + 1):
            for end in range(start, n + 1):
                part = Part.flat(shape, start, end)
                assert len(part.blocks) <= max(1, 2 * len(shape) - 1)
                assert torch.equal(part.take(full), full.reshape(-1)[start:end])
                assert part.flat_range() == ((start, end) if end > start else (0, 0))
                out = torch.full(shape, -1, dtype=full.dtype)
                place(out, part, part.take(full))
                assert torch.equal(out.reshape(-1)[start:end], full.reshape(-1)[start:end])
                assert (out.reshape(-1)[:start] == -1).all() and (out.reshape(-1)[end:] == -1).all()


def test_strided_index_ranges_become_boxes_in_local_order() -> None:
    """What ``Shard(0)`` then ``_StridedShard(0, sf=2)`` gives a rank: global rows 1 and 3 (and
    column ranges 0-1, 4): one box per combination of ranges, each where the local shard holds it."""
    shape = (4, 6)
    full = torch.arange(24).reshape(shape)
    part = Part.grid(shape, [[1, 3], [0, 1, 4]])
    assert len(part.blocks) == 4 and part.flat_range() is None and part.dense  # one-row boxes lie back to back
    assert not Part.grid(shape, [[0, 1], [0, 1, 4]]).dense  # two rows of two columns, then one column: not
    local = full[[1, 3]][:, [0, 1, 4]]
    assert torch.equal(part.take(full), local.reshape(-1))
    out = torch.zeros_like(full)
    place(out, part, local.reshape(-1))
    assert torch.equal(out[[1, 3]][:, [0, 1, 4]], local) and int(out.count_nonzero()) == 6
    others = Part.grid(shape, [[0, 2], range(6)]), Part.grid(shape, [[1, 3], [2, 3, 5]])
    assert tiles(shape, part.boxes + others[0].boxes + others[1].boxes)
    assert not tiles(shape, part.boxes + others[0].boxes)


def test_a_part_its_layout_does_not_describe_is_gathered_and_tiled() -> None:
    """A tensor with no layout, or whose layout says this rank holds something else, is gathered
    (here from the one process) and checked like any listed layout; the others stay derived."""
    from shardavg.layouts.shard_layout import ShardLayout
    from shardavg.layouts.tensor_layout import ListedLayout, MeshLayout, world_grid

    whole = MeshLayout((4, 6), world_grid(1), (("replicate",),))
    infos = [
        TensorInfo("a", (), "param", torch.Size((4, 6)), torch.float32, True, Part.whole((4, 6)), whole),
        TensorInfo("b", (), "param", torch.Size((4, 6)), torch.float32, True, Part.whole((4, 6)), None),
        TensorInfo("c", (), "param", torch.Size((4, 6)), torch.float32, True, Part.flat((4, 6), 0, 12), whole),
    ]
    with pytest.raises(
        LayoutError, match=r"the shards of 'c' \(shape \(4, 6\)\) do not tile it: rank 0 holds \[0, 12\)"
    ):
        ShardLayout.build(infos)
    infos[2] = TensorInfo("c", (), "param", torch.Size((4, 6)), torch.float32, True, Part.whole((4, 6)), None)
    layout = ShardLayout.build(infos)
    assert layout.gathered == (1, 2) and layout.layouts[0] is whole
    assert all(isinstance(layout.layouts[i], ListedLayout) for i in (1, 2)) and layout.owns(2, 0)


def test_rows_of_every_kind_of_part_tile_the_piece_and_read_back() -> None:
    """Rows [start, stop) of a tensor, gathered from the parts that tile it (flat ranges, columns,
    strided ranges, the whole): each part's ``rows_of`` placed by its ``within_rows`` rebuilds the
    piece exactly, the boxes tile it, and a part holding none of those rows contributes nothing."""
    shape = (7, 6, 5)
    full = torch.arange(210, dtype=torch.float32).view(shape)
    tilings = {
        "flat ranges": [Part.flat(shape, a, b) for a, b in [(0, 37), (37, 100), (100, 101), (101, 210)]],
        "columns": [Part.grid(shape, [range(7), cols, range(5)]) for cols in ([0, 1], [2, 3, 4], [5])],
        "strided ranges": [Part.grid(shape, [rows, range(6), range(5)]) for rows in ([0, 3, 4], [1, 2, 6], [5])],
        "whole": [Part.whole(shape)],
    }
    for label, parts in tilings.items():
        for start, stop in [(0, 7), (0, 1), (2, 5), (6, 7), (3, 4)]:
            piece = torch.full((stop - start, 6, 5), -1.0)
            boxes = []
            for part in parts:
                held = part.within_rows(start, stop)
                packed = part.rows_of(part.take(full), start, stop)
                assert packed.numel() == held.numel, (label, start, stop)
                place(piece, held, packed)
                boxes += held.boxes
            assert torch.equal(piece, full[start:stop]), (label, start, stop)
            assert tiles(piece.shape, boxes), (label, start, stop)
