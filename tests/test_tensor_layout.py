"""Derived layouts: any rank's part computed from the engine's rule equals what the engine does.

DTensor's placements are checked against DTensor's own split (``Shard._split_tensor`` and
``_StridedShard._split_tensor``, applied mesh dim by mesh dim as ``distribute_tensor`` does) on a
tensor of global indices, for every coordinate of grids up to 3-d; flat partitions against the
ranges FSDP1 and ZeRO-3 give; the owned chunks, replicas and box lookups against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardavg import LayoutError
from shardavg.layouts.parts import Part, intersect, tiles
from shardavg.layouts.tensor_layout import FlatLayout, MeshLayout, make_grid

SHAPES = [(11, 6), (4, 6), (7,), (2, 3, 5), (0, 3), (1, 1)]
PLACEMENTS = {  # grid shape -> placements per grid dim
    (4,): [[("shard", 0)], [("shard", -1)], [("replicate",)]],
    (2, 2): [
        [("replicate",), ("shard", 0)],
        [("shard", 0), ("shard", 0)],
        [("shard", 0), ("shard", -1)],
        [("strided_shard", 0, 2), ("shard", 0)],
    ],
    (2, 3): [[("shard", -1), ("replicate",)], [("strided_shard", 0, 3), ("shard", 0)], [("shard", 0), ("shard", 0)]],
    (2, 2, 2): [[("replicate",), ("shard", 0), ("shard", -1)], [("replicate",), ("strided_shard", 0, 2), ("shard", 0)]],
}


def dtensor_local(full: torch.Tensor, grid_shape: tuple[int, ...], placements, coordinate) -> torch.Tensor:
    """What ``distribute_tensor`` leaves on the rank at ``coordinate``, by torch's own split code."""
    local = full
    for size, placement, index in zip(grid_shape, placements, coordinate):
        if placement[0] == "replicate":
            continue
        dim = placement[1] % full.ndim
        split = Shard(dim) if placement[0] == "shard" else _StridedShard(dim, split_factor=placement[2])
        local = split._split_tensor(local, size, with_padding=False, contiguous=True)[0][index]
    return local


def cases():
    for shape in SHAPES:
        for grid_shape, options in PLACEMENTS.items():
            for placements in options:
                if any(p[0] != "replicate" for p in placements) and (not shape or 0 in shape[:1]):
                    continue
                if any(p[0] != "replicate" and p[1] % len(shape) >= len(shape) for p in placements):
                    continue
                yield shape, grid_shape, placements


@pytest.mark.parametrize("shape, grid_shape, placements", list(cases()))
def test_mesh_layouts_match_dtensors_own_split(shape, grid_shape, placements) -> None:
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    ranks = list(range(len(list(itertools.product(*map(range, grid_shape))))))
    random.Random(0).shuffle(ranks)  # a mesh's ranks need not be in order
    grid = make_grid(grid_shape, ranks)
    normal = tuple(p if p[0] == "replicate" else (p[0], p[1] % len(shape), *p[2:]) for p in placements)
    layout = MeshLayout(shape, grid, normal)
    for position, coordinate in enumerate(itertools.product(*map(range, grid_shape))):
        want = dtensor_local(full, grid_shape, placements, coordinate)
        part = layout.part(ranks[position])
        assert part.numel == want.numel()
        got = torch.empty(part.numel, dtype=full.dtype)
        for block in part.blocks:  # the local shard read through the part's blocks: the same global indices
            block.view(got).copy_(full[tuple(slice(o, o + s) for o, s in zip(block.offsets, block.sizes))])
        assert torch.equal(got, want.reshape(-1)), (coordinate, part)
    layout.check("w")
    assert tiles(shape, [box for _, part in layout.owned for box in part.boxes])
    assert layout.part(max(ranks) + 1) == Part.empty(shape)  # a rank outside the grid holds nothing


def test_owners_and_replicas_follow_the_lowest_rank() -> None:
    grid = make_grid((2, 2), [3, 1, 2, 0])  # rows are replicas of each other
    layout = MeshLayout((4, 6), grid, (("replicate",), ("shard", 0)))
    assert [(owner, part.flat_range()) for owner, part in layout.owned] == [(0, (12, 24)), (2, (0, 12))]
    assert layout.owner_of(3) == 2 and layout.owner_of(1) == 0 and layout.owner_of(7) is None
    assert layout.replicas(2) == [3] and layout.replicas(0) == [1]


def test_flat_layouts_are_the_ranges_fsdp1_and_zero3_give() -> None:
    numel, chunk = 60, 17  # a 10 x 6 parameter at offset 7 of a flat buffer of 4 x 17
    grid = make_grid((2, 4), range(8))  # 2 replicas of a 4-way partition (hybrid sharding)
    layout = FlatLayout((10, 6), grid, 1, chunk, 7)
    for rank in range(8):
        index = rank % 4
        start, end = min(max(index * chunk - 7, 0), numel), min(max((index + 1) * chunk - 7, 0), numel)
        assert layout.part(rank) == Part.flat((10, 6), start, max(start, end))
    assert [owner for owner, _ in layout.owned] == [0, 1, 2, 3]
    assert layout.owner_of(6) == 2 and layout.replicas(2) == [6]
    layout.check("w")
    with pytest.raises(LayoutError, match=r"the shards of 'w' \(shape \(10, 6\)\) do not tile it"):
        FlatLayout((10, 6), grid, 1, chunk, 9).check("w")  # one element past the buffer's end


@pytest.mark.parametrize("seed", range(4))
def test_box_lookups_find_exactly_the_overlapping_chunks(seed) -> None:
    rng = random.Random(seed)
    layouts = [
        MeshLayout((12, 10), make_grid((2, 3), range(6)), (("shard", 0), ("shard", 1))),
        MeshLayout((12, 10), make_grid((2, 3), [5, 3, 1, 0, 2, 4]), (("replicate",), ("shard", 1))),
        MeshLayout((12, 10), make_grid((2, 2), range(4)), (("strided_shard", 0, 2), ("shard", 0))),
        FlatLayout((12, 10), make_grid((5,), range(5)), 0, 29, 3),
    ]
    for layout in layouts:
        saved = [(owner, block) for owner, part in layout.owned for block in part.packed().blocks]
        for _ in range(50):
            offsets = (rng.randrange(12), rng.randrange(10))
            sizes = (rng.randrange(1, 13 - offsets[0]), rng.randrange(1, 11 - offsets[1]))
            want = {(o, b) for o, b in saved if intersect((b.offsets, b.sizes), (offsets, sizes))}
            got = {
                (o, b)
                for o, b in layout.candidates((offsets, sizes))
                if intersect((b.offsets, b.sizes), (offsets, sizes))
            }
            assert got == want


def test_a_grid_keeps_its_copies_and_cuts_to_a_stage() -> None:
    grid = make_grid((2, 2), [0, 2, 1, 3])  # copies [0, 2] and [1, 3]
    assert make_grid((4,), [0, 1, 2, 3]).ranks == range(4)
    layout = MeshLayout((4,), grid, (("replicate",), ("shard", 0)))
    stage = layout.within({1, 3})
    assert stage is not None and list(stage.grid.ranks) == [1, 3] and stage.part(3) == Part.flat((4,), 2, 4)
    assert layout.within({1, 2}) is None  # a copy split between stages cannot be said as one layout
    with pytest.raises(LayoutError, match="distinct ranks"):
        make_grid((2,), [1, 1])
