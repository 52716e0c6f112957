"""Which elements of a global tensor a rank's local shard holds: a ``Part``, made of boxes.

A box is the N-dimensional block ``offsets .. offsets + sizes`` of the global tensor, as a
chunk of torch's distributed checkpoint describes one on disk. Every engine's local shard is a part:

- a DTensor's local shard (FSDP2, HSDP, tensor and expert parallel) holds, along each dim,
  some of the global indices; usually one box (``Shard(d)`` on any dims, uneven or empty), in
  general the product of ranges of consecutive indices (``_StridedShard``), one box per product;
- a flat range ``[start, end)`` of the flattened tensor (an FSDP1 flat parameter's slice, a
  ZeRO-3 partition, a ZeRO-1/2 master fragment) is at most ``2 * ndim - 1`` boxes: a partial
  row, full rows, a partial row, recursively. It is the one-dimensional special case;
- a tensor held whole is one box; a tensor this rank does not hold (another pipeline stage's)
  is no box at all.

Each ``Block`` also says where its elements sit in the local shard read flat (row-major): from
element ``at``, with ``strides``. So the same few functions gather, save and load every layout,
and ``tiles`` checks that the parts the ranks own cover every tensor exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a dense array of ``sizes``."""
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Block:
    """One box of the global tensor, and where its elements are in the flat local shard."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: int  # the flat local position of the box's first element
    strides: tuple[int, ...]  # element strides of the box within the flat local shard

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def dense(self) -> bool:
        """Whether the box's elements are back to back, row-major, in the local shard."""
        return all(
            stride == want for size, stride, want in zip(self.sizes, self.strides, contiguous_strides(self.sizes))
            if size > 1
        )  # fmt: skip

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The box's elements as a view of ``flat`` (a contiguous flat local shard), shaped ``sizes``."""
        return flat.as_strided(self.sizes, self.strides, flat.storage_offset() + self.at)


@dataclass(frozen=True)
class Part:
    """The boxes of a global tensor of ``shape`` that one local shard holds, and its element count."""

    shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    numel: int  # elements of the local shard

    # ------------------------------------------------------------------ building

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Part:
        """The whole tensor, in its own order (a replica, a buffer, an unsharded parameter)."""
        shape = tuple(shape)
        return cls.flat(shape, 0, math.prod(shape))

    @classmethod
    def empty(cls, shape: Sequence[int]) -> Part:
        """Nothing of the tensor (another pipeline stage's)."""
        return cls(tuple(shape), (), 0)

    @classmethod
    def flat(cls, shape: Sequence[int], start: int, end: int) -> Part:
        """Elements ``[start, end)`` of the flattened tensor, as boxes back to back."""
        shape = tuple(shape)
        if not 0 <= start <= end <= math.prod(shape):
            raise ValueError(f"[{start}, {end}) is not a range of a tensor of shape {shape}")
        blocks, at = [], 0
        for offsets, sizes in _flat_boxes(shape, start, end):
            blocks.append(Block(offsets, sizes, at, contiguous_strides(sizes)))
            at += math.prod(sizes)
        return cls(shape, tuple(blocks), end - start)

    @classmethod
    def grid(cls, shape: Sequence[int], indices: Sequence[Sequence[int]]) -> Part:
        """A local shard of shape ``[len(i) for i in indices]`` whose element at local position
        ``(p0, p1, ...)`` is the global element ``(indices[0][p0], indices[1][p1], ...)``: one box per
        combination of ranges of consecutive indices."""
        return cls.from_ranges(shape, [[(first, length) for first, length, _ in _ranges(dim)] for dim in indices])

    @classmethod
    def from_ranges(cls, shape: Sequence[int], ranges: Sequence[Sequence[tuple[int, int]]]) -> Part:
        """``grid`` with each dimension's indices given as ranges ``(first, length)`` of consecutive
        ones (adjacent ranges are merged), so a long dimension costs its ranges, not its indices."""
        shape = tuple(shape)
        merged = [_merged(dim) for dim in ranges]
        local_shape = tuple(sum(length for _, length in dim) for dim in merged)
        local_strides = contiguous_strides(local_shape)
        placed = [_positions(dim) for dim in merged]
        blocks = []
        for combination in _product(placed):
            offsets = tuple(first for first, _, _ in combination)
            sizes = tuple(length for _, length, _ in combination)
            at = sum(position * stride for (_, _, position), stride in zip(combination, local_strides))
            blocks.append(Block(offsets, sizes, at, local_strides))
        return cls(shape, tuple(blocks), math.prod(local_shape))

    # ------------------------------------------------------------------ reading

    @property
    def boxes(self) -> list[Box]:
        return [(block.offsets, block.sizes) for block in self.blocks]

    @property
    def dense(self) -> bool:
        """Whether the local shard holds its boxes one after the other, each row-major."""
        at = 0
        for block in self.blocks:
            if block.at != at or not block.dense:
                return False
            at += block.numel
        return at == self.numel

    def flat_range(self) -> tuple[int, int] | None:
        """``(start, end)`` when the local shard is exactly that range of the flattened tensor, in
        order (a flat range, rows of ``Shard(0)``, the whole tensor); otherwise None."""
        if not self.dense:
            return None
        start = position = None
        for block in self.blocks:
            flat = box_range(self.shape, block.offsets, block.sizes)
            if flat is None or (position is not None and flat[0] != position):
                return None
            start = flat[0] if start is None else start
            position = flat[1]
        if start is None:
            return (0, 0) if self.numel == 0 else None
        return start, position

    def shown(self) -> str:
        """The part in a message: its range of the flattened tensor, or its boxes."""
        flat = self.flat_range()
        if flat is not None:
            return f"[{flat[0]}, {flat[1]})"
        boxes = [f"{list(offsets)}+{list(sizes)}" for offsets, sizes in self.boxes]
        return "boxes " + (", ".join(boxes[:4]) + (", ..." if len(boxes) > 4 else "") if boxes else "none")

    def packed(self) -> Part:
        """The part as a file stores it: the same boxes back to back, each row-major."""
        blocks, at = [], 0
        for block in self.blocks:
            blocks.append(Block(block.offsets, block.sizes, at, contiguous_strides(block.sizes)))
            at += block.numel
        return Part(self.shape, tuple(blocks), at)

    def within_rows(self, start: int, stop: int) -> Part:
        """What this part holds of rows ``[start, stop)`` of the tensor, as a part of a tensor of
        those rows alone (shape ``(stop - start, *shape[1:])``), its boxes back to back in this part's order: how
        ``rows_of`` packs them."""
        blocks, at = [], 0
        for block, low, high in self._row_blocks(start, stop):
            sizes = (high - low, *block.sizes[1:])
            blocks.append(Block((low - start, *block.offsets[1:]), sizes, at, contiguous_strides(sizes)))
            at += math.prod(sizes)
        return Part((stop - start, *self.shape[1:]), tuple(blocks), at)

    def rows_of(self, flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """This part's elements within rows ``[start, stop)``, taken from its local shard ``flat``,
        flat and packed as ``within_rows`` lays them out (a view where they are one range)."""
        views = [
            block.view(flat).narrow(0, low - block.offsets[0], high - low).reshape(-1)
            for block, low, high in self._row_blocks(start, stop)
        ]
        if not views:
            return flat[:0]
        return views[0] if len(views) == 1 else torch.cat(views)

    def _row_blocks(self, start: int, stop: int) -> Iterator[tuple[Block, int, int]]:
        """Each non-empty block across rows ``[start, stop)``, with the rows it holds of them."""
        for block in self.blocks:
            low, high = max(start, block.offsets[0]), min(stop, block.offsets[0] + block.sizes[0])
            if high > low and all(block.sizes):
                yield block, low, high

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This part's elements of the full tensor ``full``, flat, in local order (a copy)."""
        out = torch.empty(self.numel, dtype=full.dtype, device=full.device)
        place_from(full.reshape(self.shape), self, out)
        return out


def place(full: torch.Tensor, part: Part, flat: torch.Tensor) -> None:
    """Write a local shard ``flat`` (contiguous, ``part.numel`` elements) into the full tensor ``full``."""
    for block in part.blocks:
        full[box_slices(block.offsets, block.sizes)].copy_(block.view(flat))


def place_from(full: torch.Tensor, part: Part, flat: torch.Tensor) -> None:
    """Fill a local shard ``flat`` (contiguous) with its elements of the full tensor ``full``."""
    for block in part.blocks:
        block.view(flat).copy_(full[box_slices(block.offsets, block.sizes)])


# ---------------------------------------------------------------------- box geometry


def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def box_range(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> tuple[int, int] | None:
    """The range of the flattened tensor a box covers, when its elements are back to back there."""
    if not all(sizes):
        return None
    first = next((d for d, size in enumerate(sizes) if size > 1), len(sizes))
    if any(offsets[d] or sizes[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    strides = contiguous_strides(shape)
    start = sum(o * s for o, s in zip(offsets, strides))
    return start, start + math.prod(sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None."""
    offsets, sizes = [], []
    for a_offset, a_size, b_offset, b_size in zip(*a, *b):
        low, high = max(a_offset, b_offset), min(a_offset + a_size, b_offset + b_size)
        if high <= low:
            return None
        offsets.append(low)
        sizes.append(high - low)
    return tuple(offsets), tuple(sizes)


def within(shape: Sequence[int], box: Box) -> bool:
    offsets, sizes = box
    return (
        len(offsets) == len(sizes) == len(shape)
        and all(o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(offsets, sizes, shape))
    )  # fmt: skip


def tiles(shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Whether the non-empty ``boxes`` cover the tensor of ``shape`` exactly, each element once.

    The one tiling check: the layout applies it to the parts the ranks own, and every checkpoint
    reader to the chunk table it is given, so a partial or overlapping table is refused. A sweep
    along the first dimension, recursing into the rest: about ``n log n`` for ``n`` boxes in the
    layouts engines make (rows, columns, flat ranges)."""
    shape = tuple(shape)
    boxes = [(tuple(o), tuple(s)) for o, s in boxes if all(s)]
    if not all(within(shape, box) for box in boxes):
        return False
    if math.prod(shape) == 0:
        return not boxes
    return _tiles(shape, boxes)


def _tiles(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    if not shape:  # a single element: exactly one box holds it
        return len(boxes) == 1
    cuts = sorted({0, shape[0], *(o[0] for o, _ in boxes), *(o[0] + s[0] for o, s in boxes)})
    by_start = sorted(boxes, key=lambda box: box[0][0])
    active: list[Box] = []
    taken = 0
    for low in cuts[:-1]:  # the rows between two cuts: the boxes across them must tile the rest
        active = [box for box in active if box[0][0] + box[1][0] > low]
        while taken < len(by_start) and by_start[taken][0][0] == low:
            active.append(by_start[taken])
            taken += 1
        if not _tiles(shape[1:], [(o[1:], s[1:]) for o, s in active]):
            return False
    return True


# ---------------------------------------------------------------------- helpers


def _flat_boxes(shape: tuple[int, ...], start: int, end: int) -> Iterator[Box]:
    """Boxes covering ``[start, end)`` of the flattened tensor, in order: a partial row, the full
    rows, a partial row (each partial row recursively the same)."""
    if start >= end:
        return
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    first_row, first_column = divmod(start, inner)
    last_row, last_column = divmod(end, inner)
    rest = (0,) * (len(shape) - 1)
    if first_row == last_row:  # within one row
        for offsets, sizes in _flat_boxes(shape[1:], first_column, last_column):
            yield (first_row, *offsets), (1, *sizes)
        return
    if first_column:
        for offsets, sizes in _flat_boxes(shape[1:], first_column, inner):
            yield (first_row, *offsets), (1, *sizes)
        first_row += 1
    if last_row > first_row:
        yield (first_row, *rest), (last_row - first_row, *shape[1:])
    if last_column:
        for offsets, sizes in _flat_boxes(shape[1:], 0, last_column):
            yield (last_row, *offsets), (1, *sizes)


def _ranges(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first global index, length, first local position)`` of each range of consecutive indices."""
    ranges: list[tuple[int, int, int]] = []
    for position, index in enumerate(indices):
        if ranges and index == ranges[-1][0] + ranges[-1][1]:
            first, length, at = ranges[-1]
            ranges[-1] = (first, length + 1, at)
        else:
            ranges.append((index, 1, position))
    return ranges


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges with adjacent ones joined and empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for first, length in ranges:
        if length and merged and merged[-1][0] + merged[-1][1] == first:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        elif length:
            merged.append((first, length))
    return merged


def _positions(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(first, length, first local position)`` of each range, the ranges back to back locally."""
    placed, position = [], 0
    for first, length in ranges:
        placed.append((first, length, position))
        position += length
    return placed


def _product(ranges: list[list[tuple[int, int, int]]]) -> Iterator[tuple[tuple[int, int, int], ...]]:
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (first, *rest)
