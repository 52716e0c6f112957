"""Shard layouts: owned chunks must tile every tensor, replicas are owned by the lowest rank."""

from __future__ import annotations

import pytest

from shardavg import LayoutError
from shardavg.layout import _tiling


def test_shards_tile_a_tensor_and_empty_ranks_own_nothing() -> None:
    assert _tiling("w", 10, [(0, 4), (4, 8), (8, 10), (10, 10)]) == ((0, 0, 4), (1, 4, 8), (2, 8, 10))


def test_replicas_are_owned_by_the_lowest_rank() -> None:
    assert _tiling("w", 6, [(0, 6), (0, 6), (0, 6)]) == ((0, 0, 6),)
    assert _tiling("w", 6, [(0, 3), (3, 6), (0, 3), (3, 6)]) == ((0, 0, 3), (1, 3, 6))  # HSDP


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
        LayoutError, match=r"the shards of 'block.up.weight' \(10 elements\) do not tile it: rank 0 holds"
    ):
        _tiling("block.up.weight", 10, ranges)
