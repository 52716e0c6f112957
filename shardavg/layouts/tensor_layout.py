"""How one tensor is laid out over the ranks: any rank's part, derived from what every rank knows.

An engine shards a tensor by a rule that every rank already knows: DTensor's placements over
a device mesh (``torch.chunk`` along a dim per mesh dim that shards it, replicas along the
others), or a flat buffer split in equal ranges (FSDP1, ZeRO-3, ZeRO-1/2's fp32 groups). A ``TensorLayout`` is that
rule, written down once per tensor and the same on every rank, so any rank's part is computed
when it is needed instead of being gathered from every rank:

- ``MeshLayout``: placements on a ``Grid`` of ranks, ``("shard", d)``, ``("strided_shard", d,
  split_factor)`` (FSDP2 over tensor parallel on the same dim) or ``("replicate",)`` per grid
  dim; a tensor held whole on every rank is all ``replicate``; ranks outside the grid hold none;
- ``FlatLayout``: the tensor sits at ``[offset, offset + numel)`` of a flat buffer that is split
  along one grid dim into ranges of ``range_numel`` elements (replicated along the others);
- ``ListedLayout``: every rank's part, listed (gathered), for what cannot be derived.

Each answers ``part(rank)``, the ``owned`` parts (the lowest rank holding a part owns it),
``owner_of`` and ``replicas`` (from a rank's coordinate, no pass over every rank), ``check``
(that the owned parts tile the tensor: by construction for ``torch.chunk``'s split, by
arithmetic for a flat partition, by a sweep over listed parts), ``candidates(box)`` (the saved
blocks a box may overlap) and its JSON form, which a checkpoint's manifest stores once per
tensor (and each grid once), so it never lists tensors x ranks.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..base.errors import LayoutError
from .parts import Block, Box, Part, intersect, tiles

LAYOUT_BOXES = 2**22  # boxes a layout read from a file may cut a tensor into, over all its parts
# (4,096 ranks of FSDP2 over 64-way tensor parallelism: 262,144)
Owned = tuple[int, Part]  # (owner rank, the part of the tensor it owns: no lower rank holds it)
Placement = tuple  # ("replicate",), ("shard", dim) or ("strided_shard", dim, split_factor)


@dataclass(frozen=True, eq=False)
class Grid:
    """Ranks arranged as an N-d array, row-major (a device mesh's, a process group's as 1-d).

    Compared by identity: make one per mesh (``grid_of``) and share it."""

    shape: tuple[int, ...]
    ranks: Sequence[int]  # a ``range`` for the common 0 .. n-1

    @functools.cached_property
    def _coordinates(self) -> dict[int, tuple[int, ...]] | None:
        if self.ranks == range(math.prod(self.shape)):
            return None  # computed from the rank itself
        return {rank: _unravel(position, self.shape) for position, rank in enumerate(self.ranks)}

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """Where ``rank`` sits in the grid, or None when it is not in it."""
        coordinates = self._coordinates
        if coordinates is None:
            return _unravel(rank, self.shape) if 0 <= rank < len(self.ranks) else None
        return coordinates.get(rank)

    def rank_at(self, coordinate: Sequence[int]) -> int:
        position = 0
        for index, size in zip(coordinate, self.shape):
            position = position * size + index
        return self.ranks[position]

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(repr((self.shape, list(self.ranks))).encode()).hexdigest()

    def copies(self, coordinate: tuple[int, ...], dims: tuple[int, ...]) -> list[int]:
        """The ranks at ``coordinate`` with its indices along ``dims`` taking every value, in grid order."""
        return [
            self.rank_at(tuple(dict(zip(dims, indices)).get(d, c) for d, c in enumerate(coordinate)))
            for indices in itertools.product(*(range(self.shape[d]) for d in dims))
        ]

    def to_json(self) -> dict[str, Any]:
        if self.ranks == range(math.prod(self.shape)):
            return {"shape": list(self.shape)}
        return {"shape": list(self.shape), "ranks": list(self.ranks)}

    def shown(self) -> str:
        ranks = self.ranks
        if isinstance(ranks, range) or list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
            listed = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        else:
            listed = f"ranks {', '.join(map(str, list(ranks)[:6]))}{', ...' if len(ranks) > 6 else ''}"
        return listed + (f" as a {' x '.join(map(str, self.shape))} grid" if len(self.shape) > 1 else "")


def make_grid(shape: Sequence[int], ranks: Sequence[int]) -> Grid:
    """A grid of ``ranks`` (row-major) of ``shape``; 0 .. n-1 in order is kept as a ``range``."""
    shape, ranks = tuple(shape), list(ranks)
    if len(ranks) != math.prod(shape) or len(set(ranks)) != len(ranks) or min(ranks, default=0) < 0:
        raise LayoutError(f"a grid of shape {shape} needs as many distinct ranks, got {ranks[:16]}")
    return Grid(shape, range(len(ranks)) if ranks == list(range(len(ranks))) else tuple(ranks))


@functools.lru_cache(maxsize=64)
def world_grid(world_size: int) -> Grid:
    """Every rank of the default group, in order."""
    return Grid((world_size,), range(world_size))


def grid_from_json(value: Any) -> Grid:
    """A grid from its JSON form (checked by ``format.py`` first); 0 .. n-1 left out stays a ``range``."""
    shape = tuple(value["shape"])
    if "ranks" not in value:
        return Grid(shape, range(math.prod(shape)))
    return make_grid(shape, value["ranks"])


class TensorLayout:
    """Where a tensor of ``shape`` lies on the ranks; subclasses say ``part(rank)``."""

    shape: tuple[int, ...]

    def part(self, rank: int) -> Part:
        raise NotImplementedError

    def ranks(self) -> Sequence[int]:
        """Every rank that may hold some of the tensor, in increasing order."""
        raise NotImplementedError

    @property
    def owned(self) -> tuple[Owned, ...]:
        """``(owner, part)`` for each distinct non-empty part, owned by the lowest rank holding it."""
        return _owners(self)[0]

    def owner_of(self, rank: int) -> int | None:
        """The rank owning the part ``rank`` holds (itself, or the lowest replica); None if it holds none."""
        part = self.part(rank)
        return _owners(self)[1].get(part) if part.numel else None

    def replicas(self, owner: int) -> list[int]:
        """The other ranks holding the part ``owner`` owns."""
        return _replicas(self).get(owner, [])

    def check(self, name: str) -> None:
        """Raise ``LayoutError`` naming ``name`` unless the owned parts tile the tensor exactly."""
        if not _tiled(self):
            ranks = list(self.ranks())
            shown = ", ".join(f"rank {rank} holds {self.part(rank).shown()}" for rank in ranks[:16])
            more = ", ..." if len(ranks) > 16 else ""
            rule = "" if isinstance(self, ListedLayout) else f" (the layout: {self.shown()})"
            raise LayoutError(f"the shards of {name!r} (shape {self.shape}) do not tile it: {shown}{more}{rule}")

    def candidates(self, box: Box) -> list[tuple[int, Block]]:
        """``(owner, block as saved)`` of the owned parts' blocks that may overlap ``box`` (the saved
        block: its elements back to back in the owner's file entry)."""
        return _box_index(self).near(box)

    def key(self) -> tuple:
        """What the layout is, without the grid's ranks (its digest instead): compared across ranks."""
        raise NotImplementedError

    def in_ranges(self) -> bool:
        """Whether every rank's part is one range of the flattened tensor (rows along dim 0, a flat
        partition, the whole): then each part's bytes lie back to back in a file of the tensor."""
        return all(part.flat_range() is not None for _, part in self.owned)

    def to_json(self, grid_index: dict[str, int]) -> dict[str, Any]:
        """The layout as a manifest stores it, its grid by index (``grid_index``: by the grid's digest)."""
        raise NotImplementedError

    def shown(self) -> str:
        raise NotImplementedError


class GridLayout(TensorLayout):
    """A layout over a ``Grid`` whose ranks along ``replicated`` grid dims hold the same part, and
    along the others distinct parts (or none): the owner of a part and its replicas follow from
    a rank's coordinate alone, without a pass over every rank."""

    grid: Grid

    @property
    def replicated(self) -> tuple[int, ...]:
        raise NotImplementedError

    def ranks(self) -> Sequence[int]:
        return sorted(self.grid.ranks)

    def owner_of(self, rank: int) -> int | None:
        coordinate = self.grid.coordinate(rank)
        if coordinate is None or not self.part(rank).numel:
            return None
        return rank if not self.replicated else min(self.grid.copies(coordinate, self.replicated))

    def replicas(self, owner: int) -> list[int]:
        coordinate = self.grid.coordinate(owner)
        if coordinate is None or not self.replicated or self.owner_of(owner) != owner:
            return []
        return sorted(rank for rank in self.grid.copies(coordinate, self.replicated) if rank != owner)


@dataclass(frozen=True)
class MeshLayout(GridLayout):
    """DTensor's rule: per grid dim a placement; the shards along a tensor dim are what its
    ``Shard`` / ``_StridedShard`` placements cut, in grid-dim order, as ``torch.chunk`` does."""

    shape: tuple[int, ...]
    grid: Grid
    placements: tuple[Placement, ...]

    def part(self, rank: int) -> Part:
        return _mesh_part(self, rank)

    @property
    def replicated(self) -> tuple[int, ...]:
        return tuple(d for d, placement in enumerate(self.placements) if placement[0] == "replicate")

    def check(self, name: str) -> None:
        """Each ``Shard`` or ``_StridedShard`` cuts the indices left along its dim into disjoint
        ranges that cover them (``torch.chunk``'s), so the parts of distinct coordinates along the
        sharding grid dims tile the tensor by construction: what is checked is that the rule is one."""
        ndim = len(self.shape)
        if len(self.placements) != len(self.grid.shape) or any(
            p[0] != "replicate" and not (0 <= p[1] < ndim and (p[0] == "shard" or p[2] >= 1)) for p in self.placements
        ):
            raise LayoutError(
                f"{name!r} (shape {self.shape}): placements {self.placements} do not fit a grid of {self.grid.shape}"
            )

    def candidates(self, box: Box) -> list[tuple[int, Block]]:
        """Where each tensor dim is cut by one ``Shard`` at most (FSDP2, TP, HSDP, EP), the blocks a
        box overlaps follow from its offsets by division; otherwise the lookup over every block."""
        acting: dict[int, int] = {}  # tensor dim -> the grid dim that shards it
        for dim, placement in enumerate(self.placements):
            if placement[0] == "strided_shard" or (placement[0] == "shard" and placement[1] in acting):
                return super().candidates(box)
            if placement[0] == "shard":
                acting[placement[1]] = dim
        if not all(box[1]):
            return []
        reached = {}  # grid dim -> the indices along it whose ranks hold some of the box
        for tensor_dim, dim in acting.items():
            size, count = self.shape[tensor_dim], self.grid.shape[dim]
            step = -(-size // count)
            first, last = box[0][tensor_dim] // step, (box[0][tensor_dim] + box[1][tensor_dim] - 1) // step
            reached[dim] = range(first, min(last, count - 1) + 1)
        found = []
        for indices in itertools.product(*reached.values()):
            coordinate = [0] * len(self.grid.shape)
            for dim, index in zip(reached, indices):
                coordinate[dim] = index
            owner = min(self.grid.copies(tuple(coordinate), self.replicated))
            found += [(owner, block) for block in self.part(owner).packed().blocks]
        return found

    def key(self) -> tuple:
        return ("mesh", self.shape, self.grid.digest, self.placements)

    def in_ranges(self) -> bool:
        """Rows: nothing but dim 0 is cut, by ``Shard`` (not strided), on any number of grid dims."""
        return all(p[0] == "replicate" or (p[0] == "shard" and p[1] == 0) for p in self.placements)

    def to_json(self, grid_index: dict[str, int]) -> dict[str, Any]:
        return {"grid": grid_index[self.grid.digest], "placements": [list(p) for p in self.placements]}

    def within(self, ranks: set[int]) -> MeshLayout | None:
        """The layout cut to the copies (rows along a leading replicated grid dim) whose ranks all
        lie in ``ranks``, with a leading replicated dim of those copies; None when a copy is split."""
        if self.placements[0] == ("replicate",):
            shape, placements = self.grid.shape, self.placements
        else:  # the whole grid is one copy
            shape, placements = (1, *self.grid.shape), (("replicate",), *self.placements)
        size = math.prod(shape[1:])
        rows = [list(self.grid.ranks[i * size : (i + 1) * size]) for i in range(shape[0])]
        kept = [row for row in rows if set(row) <= ranks]
        if not kept or any(ranks & set(row) for row in rows if row not in kept):
            return None
        return MeshLayout(self.shape, make_grid((len(kept), *shape[1:]), [r for row in kept for r in row]), placements)

    def shown(self) -> str:
        cuts = []
        for dim, placement in enumerate(self.placements):
            size = self.grid.shape[dim]
            if placement[0] == "shard":
                cuts.append(f"dim {placement[1]} split in {size} as torch.chunk does")
            elif placement[0] == "strided_shard":
                cuts.append(f"dim {placement[1]} split in {size}, strided by {placement[2]}")
            elif size > 1:
                cuts.append(f"replicated {size} times")
        return ("; ".join(cuts) if cuts else "whole") + f" over {self.grid.shown()}"


@dataclass(frozen=True)
class FlatLayout(GridLayout):
    """A flat partition: the tensor is elements ``[offset, offset + numel)`` of a flat buffer whose
    grid-dim ``dim`` index ``i`` holds elements ``[i * range_numel, (i + 1) * range_numel)`` (padding past the
    end); ranks along the other grid dims hold the same."""

    shape: tuple[int, ...]
    grid: Grid
    dim: int
    range_numel: int  # elements of each index's range (the manifest's ``"chunk"``)
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _range(self, index: int) -> tuple[int, int]:
        start = min(max(index * self.range_numel - self.offset, 0), self.numel)
        return start, min(max((index + 1) * self.range_numel - self.offset, start), self.numel)

    def _indices(self) -> range:
        """The indices along ``dim`` whose range holds some of the tensor."""
        if not self.numel or not self.range_numel:
            return range(0)
        first = self.offset // self.range_numel
        return range(first, min((self.offset + self.numel - 1) // self.range_numel + 1, self.grid.shape[self.dim]))

    def part(self, rank: int) -> Part:
        coordinate = self.grid.coordinate(rank)
        if coordinate is None:
            return Part.empty(self.shape)
        return Part.flat(self.shape, *self._range(coordinate[self.dim]))

    @property
    def replicated(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.grid.shape)) if d != self.dim)

    @property
    def owned(self) -> tuple[Owned, ...]:
        return tuple((self._owner(i), Part.flat(self.shape, *self._range(i))) for i in self._indices())

    def _owner(self, index: int) -> int:
        """The lowest rank at ``index`` along ``dim``."""
        coordinate = tuple(index if d == self.dim else 0 for d in range(len(self.grid.shape)))
        return min(self.grid.copies(coordinate, self.replicated))

    def check(self, name: str) -> None:
        if (
            self.offset < 0
            or self.range_numel < 0
            or self.offset + self.numel > self.range_numel * self.grid.shape[self.dim]
        ):
            raise LayoutError(
                f"the shards of {name!r} (shape {self.shape}) do not tile it: {self.shown()} does not reach its end"
            )

    def candidates(self, box: Box) -> list[tuple[int, Block]]:
        """Only the ranges that the box's first and last elements bound: no pass over every rank."""
        offsets, sizes = box
        if not all(sizes):
            return []
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, sizes, strides))
        held = self._indices()
        low, high = (
            max((first + self.offset) // self.range_numel, held.start),
            min((last + self.offset) // self.range_numel + 1, held.stop),
        )
        return [
            (self._owner(index), block)
            for index in range(low, high)
            for block in Part.flat(self.shape, *self._range(index)).blocks
        ]

    def key(self) -> tuple:
        return ("flat", self.shape, self.grid.digest, self.dim, self.range_numel, self.offset)

    def in_ranges(self) -> bool:
        return True

    def to_json(self, grid_index: dict[str, int]) -> dict[str, Any]:
        return {
            "grid": grid_index[self.grid.digest],
            "flat": {"dim": self.dim, "chunk": self.range_numel, "offset": self.offset},
        }

    def shown(self) -> str:
        replicated = math.prod(self.grid.shape) // self.grid.shape[self.dim]
        return (
            f"elements [{self.offset}, {self.offset + self.numel}) of a flat buffer split in ranges of "
            f"{self.range_numel} over {self.grid.shown()}"
            + (f", replicated {replicated} times" if replicated > 1 else "")
        )


@dataclass(frozen=True, eq=False)
class ListedLayout(TensorLayout):
    """Every rank's part, as gathered or as a checkpoint's chunk table lists them."""

    shape: tuple[int, ...]
    parts: tuple[Part, ...]  # [rank]

    def part(self, rank: int) -> Part:
        return self.parts[rank] if 0 <= rank < len(self.parts) else Part.empty(self.shape)

    def ranks(self) -> Sequence[int]:
        return range(len(self.parts))

    def key(self) -> tuple:
        return ("listed", self.shape, tuple(part.boxes for part in self.parts))

    def shown(self) -> str:
        return f"{len(self.owned)} parts, as listed"


def layout_from_json(value: Any, shape: Sequence[int], grids: Sequence[Grid]) -> TensorLayout:
    """A ``MeshLayout`` or ``FlatLayout`` from its JSON form (checked by ``format.py`` first)."""
    grid = grids[value["grid"]]
    if "flat" in value:
        flat = value["flat"]
        return FlatLayout(tuple(shape), grid, flat["dim"], flat["chunk"], flat["offset"])
    return MeshLayout(tuple(shape), grid, tuple(tuple(p) for p in value["placements"]))


# ---------------------------------------------------------------------- derived answers, once per layout


@functools.lru_cache(maxsize=4096)
def _owners(layout: TensorLayout) -> tuple[tuple[Owned, ...], dict[Part, int]]:
    """The owned parts and each part's owner, from every rank's part (once per distinct layout)."""
    owned: dict[Part, int] = {}
    for rank in layout.ranks():
        part = layout.part(rank)
        if part.numel:
            owned.setdefault(part, rank)
    return tuple((owner, part) for part, owner in owned.items()), owned


@functools.lru_cache(maxsize=4096)
def _replicas(layout: TensorLayout) -> dict[int, list[int]]:
    owners = _owners(layout)[1]
    found: dict[int, list[int]] = {}
    for rank in layout.ranks():
        part = layout.part(rank)
        if part.numel and owners[part] != rank:
            found.setdefault(owners[part], []).append(rank)
    return found


@functools.lru_cache(maxsize=4096)
def _tiled(layout: TensorLayout) -> bool:
    return tiles(layout.shape, [box for _, part in layout.owned for box in part.boxes])


class _BoxIndex:
    """The saved blocks of a layout's owned parts, bucketed along the tensor dim where they differ
    most, so a box finds the blocks it may overlap by bisection."""

    def __init__(self, layout: TensorLayout) -> None:
        self.blocks = [(owner, block) for owner, part in layout.owned for block in part.packed().blocks]
        ndim = len(layout.shape)
        self.dim = max(range(ndim), key=lambda d: len({b.offsets[d] for _, b in self.blocks})) if ndim else None
        if self.dim is None:
            return
        cuts = sorted(
            {b.offsets[self.dim] for _, b in self.blocks}
            | {b.offsets[self.dim] + b.sizes[self.dim] for _, b in self.blocks}
        )
        self.cuts = cuts
        self.buckets: list[list[int]] = [[] for _ in cuts]
        for position, (_, block) in enumerate(self.blocks):
            low = bisect.bisect_left(cuts, block.offsets[self.dim])
            high = bisect.bisect_left(cuts, block.offsets[self.dim] + block.sizes[self.dim])
            for bucket in range(low, high):
                self.buckets[bucket].append(position)

    def near(self, box: Box) -> list[tuple[int, Block]]:
        if self.dim is None:
            return list(self.blocks)
        start, size = box[0][self.dim], box[1][self.dim]
        low = max(bisect.bisect_right(self.cuts, start) - 1, 0)
        high = bisect.bisect_left(self.cuts, start + size)
        seen = sorted({position for bucket in self.buckets[low:high] for position in bucket})
        return [self.blocks[p] for p in seen if intersect((self.blocks[p][1].offsets, self.blocks[p][1].sizes), box)]


@functools.lru_cache(maxsize=4096)
def _box_index(layout: TensorLayout) -> _BoxIndex:
    return _BoxIndex(layout)


# ---------------------------------------------------------------------- DTensor's split, on index ranges

Ranges = tuple[tuple[int, int], ...]  # (first index, length) of each range of consecutive indices


def most_boxes(layout: MeshLayout) -> int:
    """At most how many boxes ``layout``'s distinct parts hold, all together, from its rule alone
    (nothing worked out): a ``Shard`` keeps a dim's ranges of indices (it slices them), a
    ``_StridedShard`` of split factor ``f`` adds at most ``f - 1`` (its groups' boundaries, no more
    groups than indices), a part's boxes are the product of its dims' ranges, and the distinct
    parts the product of the sharding grid dims' sizes."""
    if not math.prod(layout.shape):
        return 0
    ranges = [1] * len(layout.shape)
    parts = 1
    for size, placement in zip(layout.grid.shape, layout.placements):
        if placement[0] != "replicate":
            parts *= size
        if placement[0] == "strided_shard":
            ranges[placement[1]] += min(placement[2], layout.shape[placement[1]]) - 1
    return math.prod(ranges) * parts


def _mesh_part(layout: MeshLayout, rank: int) -> Part:
    coordinate = layout.grid.coordinate(rank)
    if coordinate is None or not math.prod(layout.shape):
        return Part.empty(layout.shape)
    ranges = []
    for dim, size in enumerate(layout.shape):
        acting = tuple(
            (layout.grid.shape[g], placement[2] if placement[0] == "strided_shard" else 0, coordinate[g])
            for g, placement in enumerate(layout.placements)
            if placement[0] != "replicate" and placement[1] == dim
        )
        ranges.append(_dim_ranges(size, acting))
    return _part_from_ranges(layout.shape, tuple(ranges))


@functools.lru_cache(maxsize=65536)
def _part_from_ranges(shape: tuple[int, ...], ranges: tuple[Ranges, ...]) -> Part:
    return Part.from_ranges(shape, ranges)


@functools.lru_cache(maxsize=65536)
def _dim_ranges(size: int, acting: tuple[tuple[int, int, int], ...]) -> Ranges:
    """The indices along a dim of ``size`` that a coordinate holds: each acting grid dim
    ``(its size, split factor or 0 for Shard, the coordinate's index there)`` cuts the indices
    left so far, in grid-dim order, as ``distribute_tensor`` does."""
    ranges: Ranges = ((0, size),) if size else ()
    for count, split_factor, index in acting:
        if split_factor:  # _StridedShard: torch.chunk in split_factor groups, each group in count, index-th of each
            total = sum(length for _, length in ranges)  # (torch.chunk makes no more groups than indices)
            groups = [_split(ranges, split_factor, group) for group in range(min(split_factor, total))]
            ranges = tuple(kept for group in groups for kept in _split(group, count, index))
        else:
            ranges = _split(ranges, count, index)
    return ranges


def _split(ranges: Ranges, count: int, index: int) -> Ranges:
    """What ``torch.chunk`` of a sequence of indices (as ranges) into ``count`` gives index ``index``
    (nothing past the last one torch makes)."""
    total = sum(length for _, length in ranges)
    size = -(-total // count) if total else 0
    return _positions(ranges, min(index * size, total), min((index + 1) * size, total))


def _positions(ranges: Ranges, start: int, end: int) -> Ranges:
    """Positions ``[start, end)`` of the sequence of indices ``ranges``."""
    out, position = [], 0
    for first, length in ranges:
        low, high = max(start, position), min(end, position + length)
        if low < high:
            out.append((first + low - position, high - low))
        position += length
        if position >= end:
            break
    return tuple(out)


def _unravel(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        position, index = divmod(position, size)
        coordinate.append(index)
    return tuple(reversed(coordinate))
