"""The process group as shardavg uses it: who this rank is, and agreeing before collective I/O.

Every step that more than one rank must take together (a save, a load, an export, a DeepSpeed
tag) first gathers each rank's outcome: one rank's failure becomes an error on every rank,
naming the ranks and what each said, instead of a rank waiting forever in a collective that
the failed one never joins. Outside a process group (one process, the offline CLI) every
function answers for a world of one.
"""

from __future__ import annotations

import torch.distributed as dist

from .errors import CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def all_gathered(value: object) -> list:
    """Collective: every rank's ``value`` (small, plain data), in rank order."""
    values = [value]
    if distributed():
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values


def gather_or_raise(
    error: BaseException | None, value: object, what: str, kind: type[Exception] = CheckpointError
) -> list:
    """Collective: every rank's ``value``; or, if any rank failed, raise ``kind`` on every rank,
    naming the ranks and their errors."""
    reports = all_gathered((None if error is None else f"{type(error).__name__}: {error}", value))
    failed = "; ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e is not None)
    if failed:
        raise kind(f"{what} failed: {failed}") from error
    return [value for _, value in reports]


def agree_or_raise(error: BaseException | None, what: str, kind: type[Exception] = CheckpointError) -> None:
    """Collective: raise ``kind`` on every rank if any rank failed, naming the ranks and their errors."""
    gather_or_raise(error, None, what, kind)
