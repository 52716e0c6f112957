"""Splitting the writing of a model folder between writers: the export's ranks, or the merge's processes.

Both split the same way. The work is a list of ``Work`` items in the files' order: each tensor,
and a tensor of more than a given number of bytes as pieces of consecutive rows of at most
that (``pieces``), so that no writer holds more than that at once and the largest tensors spread
over the writers too; the items go to the writers in consecutive sequences of about the same bytes
(``assign``). The writers are this process alone, or every rank of the process group
(``Writers``), and every step they take together ends in ``Writers.agree``: one writer's failure
is every writer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..base.dist import agree_or_raise, distributed, rank, same_everywhere, world_size
from ..base.errors import CheckpointError

Rows = tuple[int, int] | None  # rows [start, stop) of a tensor; None: all of it


@dataclass(frozen=True)
class Work:
    """What one writer takes at once: tensor ``index`` (its ``rows``, or all of it if None), written
    at the plan's ``slots`` (the tensor's names: a tied tensor is written under each)."""

    index: int
    rows: Rows
    nbytes: int  # bytes written, under every slot
    slots: tuple[int, ...]


def pieces(index: int, shape: Sequence[int], nbytes: int, slots: tuple[int, ...], largest: int) -> list[Work]:
    """Tensor ``index`` of ``shape`` (``nbytes`` written at all its ``slots``) as work: whole when it
    is at most ``largest`` bytes (or has fewer than two rows), else pieces of consecutive rows of
    at most ``largest`` bytes each (one row at least)."""
    if nbytes <= largest or not shape or shape[0] < 2:
        return [Work(index, None, nbytes, slots)]
    rows = shape[0]
    step = max(1, largest // max(1, nbytes // rows))
    return [
        Work(index, (start, min(start + step, rows)), nbytes * (min(start + step, rows) - start) // rows, slots)
        for start in range(0, rows, step)
    ]


def assign(items_bytes: list[int], writers: int) -> list[int]:
    """Each item's writer (0 .. writers-1), for items written in order: consecutive sequences of about
    the same bytes (an item is never split)."""
    total = max(1, sum(items_bytes))
    owner, start = [], 0
    for size in items_bytes:
        owner.append(min(writers - 1, (start + size // 2) * writers // total))
        start += size
    return owner


@dataclass(frozen=True)
class Writers:
    """Who writes: this process alone, or (``together``) every rank of the process group; a failure
    agreed on is raised as ``kind``."""

    rank: int
    count: int
    together: bool
    kind: type[Exception] = CheckpointError

    @classmethod
    def of(cls, together: bool, kind: type[Exception] = CheckpointError) -> Writers:
        """Every rank of the process group when ``together`` (and there is one), else this process alone."""
        together = together and distributed()
        return cls(rank() if together else 0, world_size() if together else 1, together, kind)

    @property
    def lead(self) -> bool:
        """The writer that prepares, commits and reports."""
        return self.rank == 0

    def agree(self, error: Exception | None, what: str) -> None:
        """Alone: raise its own error as it is; together: every writer raises if any failed."""
        if self.together:
            agree_or_raise(error, what, self.kind)
        elif error is not None:
            raise error

    def same(self, values: list[int]) -> bool:
        """Collective when together: whether every writer passed the same integers."""
        return not self.together or same_everywhere(values)
